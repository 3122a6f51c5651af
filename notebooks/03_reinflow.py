# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext,-jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · ReinFlow: PPO through the noisy denoising chain
#
# **The question.** Stages 1 and 2 learned from fixed data. Can a flow policy improve by acting, through a policy
# gradient, when it has no tractable likelihood for its action? ReinFlow (Zhang et al. 2025) makes the **denoising
# chain** the policy: noise added at every denoising step turns the sampler into a Gaussian MDP with an exact
# log-likelihood, and PPO runs on that. **What the records say** (held-out episodes, paired with the start):
#
# | task | start | after chain ReinFlow | record |
# |---|---|---|---|
# | FastReach-v0 (torch, 1 min of CPU) | 0.487 | **0.986-0.993**, 3 seeds | [fast tasks](../docs/fast_tasks.md), [data](../results/fast_tasks/fast_reach_mlp/) |
# | FastPush-v0 (torch, contact) | 0.672 | **0.984-0.990**, 3 seeds | [fast tasks](../docs/fast_tasks.md), [data](../results/fast_tasks/fast_push_mlp/) |
# | Meta-World pick-place / assembly (MuJoCo, CPU) | 0.620 / 0.580 | **0.930-0.970** / **0.980-0.990**, 3 seeds each | [Meta-World](../docs/results/metaworld.md), [data](../results/metaworld/) |
# | PickCube-v1, CPU scale | ~0.6 | no gain in ~50 runs | [why](../docs/explanations/cpu_scale.md) |
#
# This notebook runs each piece on one batch (a chain, its log-probability, the ratio, GAE, one PPO update), then
# trains on `FastReach-v0` (`flowlib/envs/fast_envs.py`, 512 envs stepped as torch tensors) with a control that must
# fail. The runs behind the table, and what runs where, close the notebook.

# %%
import copy

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from flowlib.policies import bc
from flowlib.infra import config, metrics, runs
from flowlib.rl import loop
from flowlib.methods import stage3
from flowlib.envs import visual
from flowlib.envs.maniskill import make_env
from flowlib.tools.run import start_checkpoint
from flowlib.infra.tracking import Tracker, start_run

# %% tags=["parameters"]
# Defaults: chain PPO on FastReach-v0 from an MLP stage-1 policy, a minute or two on 2 CPU cores. Every other
# stage-3 parameter (flowlib.methods.stage3.ChainPPOConfig) can be set too, grouped by method in
# `python -m flowlib.run 03_reinflow --show-params chain/ppo`; params/03_reinflow/ holds the larger runs.
# RunConfig: every method
seed: int = 0  # the run's seed (nets, noise, minibatches)
init_checkpoint: str = "01_shortcut_bc/fast_reach_mlp/best_model.pt"  # stage-1/2 best_model.pt, relative to outputs/; "": 01_shortcut_bc/default
env_id: str = "FastReach-v0"  # the task: ManiSkill's, Meta-World's v3 name or a fast torch task (FastReach-v0); the start checkpoint's task
num_envs: int = 512  # parallel envs (processes on physx_cpu)
num_inference_steps: int = 4  # K, the denoising steps of the flow (noisy chain or frozen ODE)
max_noise_std: float = 0.1  # upper bound of the exploration std at the start; decays to final_noise_std
final_noise_std: float = 0.04  # that bound at the end of noise_decay_steps
total_env_steps: int = 2457600  # the run's budget
rollout_steps: int = 10  # decisions per env per iteration (chunks; a per-step residual: chunks of steps)
actor_lr: float = 0.0001  # the policy's learning rate (0: the policy stays as it starts, a control)
critic_lr: float = 0.001  # the value / Q nets' learning rate
critic_warmup_steps: int = 81920  # iterations that start within these env steps update only the critic
eval_every: int = 10  # iterations between validations (pick best_model.pt); 0: only before and after
num_eval_episodes: int = 512  # episodes per evaluation
run_name: str = "default"  # the run folder, outputs/<notebook>/<run_name>
wandb_mode: str = "disabled"  # "disabled", "offline" or "online"
# ChainConfig: read by chain/ppo, chain/rfc
log_prob_over: str = "executed_last"  # the dims each step scores: "chunk" / "executed_last" (exact) or "executed"
# PPOConfig: read by chain/ppo, latent/ppo, residual/ppo, residual_step/ppo, chain/rfc, gaussian/ppo
update_epochs: int = 5  # passes over the rollout per update
minibatch_size: int = 2048  # decisions per gradient step
target_kl: float = 0.05  # approx KL past which an update stops early (0: never)
# other
run_control: bool = True  # also train the flipped-advantage control, same budget and start (it must get worse)

# %% [markdown]
# The start is the MLP flow policy that `params/01_shortcut_bc/fast_reach_mlp.yaml` clones from an imperfect
# scripted demonstrator (its demos succeed ~0.7 of the time); when it is missing, the next cell runs that stage-1
# notebook first (half a minute).

# %%
cfg = config.from_globals(stage3.ChainPPOConfig, globals())
run_path, tracker = start_run("03_reinflow", cfg)
init_path = start_checkpoint("03_reinflow", cfg)  # the default start is made when missing
env = make_env(cfg.env_id, cfg.num_envs, max_episode_steps=cfg.max_episode_steps, backend=cfg.backend,
               **visual.policy_env_kwargs(bc.checkpoint_meta(init_path)))  # a visual start's camera
torch.manual_seed(cfg.seed)
agent, value_init = stage3.build_agent(cfg, init_path, env.spec)
print(f"run folder: {runs.shown(run_path)}; from {runs.shown(init_path)}; {env.num_envs} envs on {env.backend}; "
      f"chunks of H = {agent.pred_horizon} actions of {agent.action_dim} dims, {agent.act_horizon} executed")

# %% [markdown]
# ## 1 · The denoising MDP
# With $K$ steps on the grid $t_k = k/K$, the flow's sampler becomes a Markov chain by adding learned noise at every
# step (ReinFlow, Eq. 4; `flowlib.flows.flow_sde.sample_chain`):
# $$x_{k+1} = x_k + v_\theta(x_k, t_k \mid o)\,\tfrac1K + \sigma_\theta(t_k, o)\,\epsilon_k,\qquad \epsilon_k\sim\mathcal N(0, I).$$
# Each transition is Gaussian, so the chain has an **exact** log-likelihood (Eq. 5;
# `flowlib.methods.reinflow_agent.ReinFlowAgent.log_prob`):
# $$\log\pi_\theta(x_{0:K}\mid o) = \sum_{k=0}^{K-1}\log\mathcal N\big(x_{k+1};\ x_k + v_\theta(x_k,t_k\mid o)/K,\ \sigma_\theta(t_k,o)^2 I\big).$$
# $\sigma_\theta$ is a small network squashed into $[\sigma_\min, \sigma_\max]$, and $\sigma_\max$ decays during
# training. The executed chunk is the first $T_a$ actions of $x_K$. Their other dims at the last step reach nothing,
# so `log_prob_over = "executed_last"` leaves them out of the sum: the gradient stays exact, with less variance.
# Evaluation drops the noise and runs the deterministic chain.
#
# Below: one observation, one $x_0$, sixteen draws of the step noise, and the deterministic chain, for the first
# executed action.

# %%
obs = env.reset(seed=cfg.eval_seed).cpu()                       # [N, O]; the agent is on the CPU until training
window = obs[:, None].repeat(1, agent.obs_horizon, 1)            # [N, To, O]
one = window[:1].repeat(16, 1, 1)                                # [16, To, O]: the same observation
x0 = torch.randn(1, agent.pred_horizon, agent.action_dim, generator=torch.Generator().manual_seed(cfg.seed))
noisy, log_prob = agent.sample(one, torch.Generator().manual_seed(cfg.seed), x0=x0.repeat(16, 1, 1))
ode, _ = agent.sample(one[:1], deterministic=True, x0=x0)
step = agent.obs_horizon - 1                                     # the first executed action of the chunk
fig, axes = plt.subplots(1, agent.action_dim, figsize=(4 * agent.action_dim, 2.8), squeeze=False)
for a, ax in enumerate(axes[0]):
    ax.plot(range(cfg.num_inference_steps + 1), noisy[:, :, step, a].T, color="C0", alpha=0.35, lw=1)
    ax.plot(range(cfg.num_inference_steps + 1), ode[0, :, step, a], color="k", lw=2, label="deterministic chain")
    ax.set_xlabel("denoising step k")
    ax.set_ylabel(f"action dim {a} (normalised)")
    ax.legend(fontsize=8)
fig.suptitle("x_0 (k = 0) to the executed action (k = K): noisy chains around the deterministic one")
fig.tight_layout()
runs.save_figure(fig, run_path, "chains")
plt.show()
print(f"chains {tuple(noisy.shape)} = [B, K+1, H, A]; log-probs of the 16 chains: {log_prob.numpy().round(1)}")

# %% [markdown]
# ## 2 · PPO's ratio, and why it is 1 before an update
# PPO compares the chain's likelihood under the weights being trained with the one it had when it was sampled,
# $\rho = \exp\big(\log\pi_\theta(x_{0:K}\mid o) - \log\pi_{\theta_\text{old}}(x_{0:K}\mid o)\big)$, inside the clipped
# surrogate $\mathbb E[\min(\rho A, \operatorname{clip}(\rho, 1\pm\epsilon)A)]$ (Schulman et al. 2017, Eq. 7;
# `flowlib.rl.ppo.clipped_surrogate`). Sampling and
# re-scoring are two code paths; with the same weights on the same time grid they must agree, so $\rho = 1$
# exactly. Re-scoring on another grid than sampling (a bug of a public implementation) breaks this, and every
# update checks it (`ppo.ppo_update`).

# %%
with torch.no_grad():
    rescored, _ = agent.log_prob(one, noisy)
ratio = (rescored - log_prob).exp()

# %%
# NBVAL_CHECK_OUTPUT
print(f"chain has K+1 = {cfg.num_inference_steps + 1} states: {noisy.shape[1] == cfg.num_inference_steps + 1}")
print(f"ratio == 1 before any update: {bool((ratio - 1).abs().max() < 1e-4)}")

# %% [markdown]
# ## 3 · One rollout, and GAE over chunk decisions
# A decision runs $T_a$ actions, earning $R_c = \sum_{k<\tau}\gamma^k r_{c+k}$ over the $\tau \le T_a$ steps that ran,
# so the chunks form a semi-MDP. GAE (Schulman et al. 2016, Eq. 16; `flowlib.rl.advantages.gae`) runs over decisions with the per-decision
# discount $\gamma^\tau$:
# $$\delta_c = R_c + \gamma^{\tau}(1-\text{term}_c)\,V(s_{c+\tau}) - V(s_c),\qquad A_c = \delta_c + \gamma^{\tau}\lambda\,(1-\text{end}_c)\,A_{c+1}.$$
# With the sparse reward a success pays 1 and ends the episode (no bootstrap); the time limit bootstraps from $V$.
# On a copy of the agent (the training below starts from the untouched one): two rollouts that fit only $V$, as the
# training's critic warm-up does, then one iteration's rollout and its advantages for one env.

# %%
demo = copy.deepcopy(agent)
learner = stage3.make_learner(demo, cfg)
learner.build_optimizers()
runner = loop.learning_runner(cfg, env, demo.obs_horizon, first_seed=cfg.train_seed)
learner.start(runner, torch.Generator().manual_seed(cfg.seed))
for _ in range(2):  # the critic warm-up
    _, buf, _ = learner.collect()
    warmup = learner.update(buf, train_policy=False)
print(f"after the warm-up, V explains {warmup['explained_variance']:.2f} of the returns' variance")
_, buf, _ = learner.collect()
advantages, returns = buf.advantages(cfg)
env_i = int(buf.rewards.sum(0).argmax())                         # an env that succeeded in this rollout
pd.DataFrame({"reward R_c": buf.rewards[:, env_i], "gamma^tau": buf.discounts[:, env_i],
              "success (terminal)": buf.terminal[:, env_i], "V(s_c)": buf.values[:, env_i],
              "advantage A_c": advantages[:, env_i]}).round(3).rename_axis("decision c")

# %% [markdown]
# ## 4 · One PPO update
# The update makes `update_epochs` passes over the rollout in minibatches, ascending the clipped surrogate with Adam
# and fitting $V$ to the returns; `target_kl` ends it early once the policy has moved far enough. Re-scoring the
# rollout's chains afterwards shows how the update moved their log-likelihoods. All of them move with the noise
# std; what PPO adds is the difference: chains that did better than $V$ expected gain against those that did worse.

# %%
flat = buf.flat(advantages, returns)
with torch.no_grad():
    lp_before, _ = demo.log_prob(flat["obs"], flat["chains"], flat["stochastic"])
stats = learner.update(buf, train_policy=True)
with torch.no_grad():
    lp_after, _ = demo.log_prob(flat["obs"], flat["chains"], flat["stochastic"])
moved = lp_after - lp_before
positive = flat["advantages"] > 0
print({k: round(v, 4) for k, v in stats.items() if k in ("approx_kl", "clip_frac", "policy_loss", "value_loss", "epochs")})
print(f"mean change of the chains' log-likelihood: {moved[positive].mean():+.3f} where A > 0, "
      f"{moved[~positive].mean():+.3f} where A < 0")

# %%
# NBVAL_CHECK_OUTPUT
print(f"the update raised the likelihood of better-than-expected chains relative to worse ones: "
      f"{bool(moved[positive].mean() > moved[~positive].mean())}")

# %% [markdown]
# ## 5 · Training, and a control that must fail
# The same loop for the whole budget: each iteration collects `rollout_steps` decisions per env with the noisy
# chain, then updates (only $V$ during the critic warm-up); `last.pt` is written as it goes, so a stopped run
# resumes. The control runs the same budget from the same start with the advantages' sign flipped: PPO then
# ascends the opposite of its gradient estimate, so a method that learns must get worse.

# %%
out = stage3.train(cfg, agent, env, run_path, tracker)
history = pd.DataFrame(tracker.rows)
print(f"{out['iterations']} iterations, {out['env_steps']} env steps in {out['train_time_s']:.0f} s")

policies, curves = {"chain PPO": agent}, {"chain PPO": history}
if cfg.run_control:
    control_cfg = config.validate(stage3.ChainPPOConfig, {**config.to_dict(cfg), "flip_advantages": True})
    torch.manual_seed(cfg.seed)
    policies["control: flipped"], _ = stage3.build_agent(control_cfg, init_path, env.spec)
    control_tracker = Tracker(run_path / "control_flipped", resume=cfg.resume)
    control_out = stage3.train(control_cfg, policies["control: flipped"], env, run_path / "control_flipped",
                               control_tracker)
    control_tracker.finish()
    curves["control: flipped advantages"] = pd.DataFrame(control_tracker.rows)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3))
for name, h in curves.items():
    for ax, col in zip(axes, ["eval/success_once", "train/success_once"]):
        if col in h:
            logged = h.dropna(subset=[col])  # validations are logged every eval_every iterations
            ax.plot(logged["step"], logged[col], marker=".", label=name)
for ax, col in zip(axes, ["validation success (deterministic)", "training success (noisy chain)"]):
    ax.set_xlabel("env steps")
    ax.set_ylabel("success rate")
    ax.set_title(col)
    ax.legend(fontsize=8)
fig.tight_layout()
runs.save_figure(fig, run_path, "learning_curve")
plt.show()

# %% [markdown]
# ## 6 · Before and after, on the same held-out episodes
# The start, the trained policy and the control, each run deterministically on the same `num_eval_episodes` episodes
# (env seeds from `eval_seed`, never trained on or used to pick a checkpoint), so each difference from the start is
# paired episode by episode, with its standard error.

# %%
torch.manual_seed(cfg.seed)
start, _ = stage3.build_agent(cfg, init_path, env.spec)
results = {name: bc.evaluate(policy, env, cfg.num_eval_episodes, cfg.num_inference_steps, seed=cfg.eval_seed)
           for name, policy in {"start (stage 1)": start, **policies}.items()}
paired = pd.DataFrame(metrics.paired_means({k: r["per_episode_success_once"] for k, r in results.items()}))
paired.to_csv(run_path / "before_after.csv", index=False)
paired.round(3)

# %%
# NBVAL_CHECK_OUTPUT
gain = paired.iloc[1]
print(f"chain PPO beats its start by more than 2 SE: {bool(gain['diff'] > 2 * gain['diff_se'])}")
if cfg.run_control:
    print(f"the flipped control does not beat the start: {bool(paired.iloc[2]['diff'] <= 0)}")

# %%
keys = ("success_once", "success_at_end")
tracker.summary({"init_checkpoint": str(init_path), "value_init": value_init, "env_steps": out["env_steps"],
                 "train_time_s": out["train_time_s"], "best": out["best"],
                 "before": {k: results["start (stage 1)"][k] for k in keys},
                 "after": {k: results["chain PPO"][k] for k in keys},
                 "paired_diff": {row.policy: [row.diff, row.diff_se] for row in paired.itertuples()},
                 **({"control_flipped": {k: results["control: flipped"][k] for k in keys},
                     "control_train_time_s": control_out["train_time_s"]} if cfg.run_control else {})})
tracker.finish()
env.close()
print(f"success_once {gain['mean'] - gain['diff']:.3f} -> {gain['mean']:.3f} ({gain['diff']:+.3f} +- {gain['diff_se']:.3f}, "
      f"paired, {int(gain['episodes'])} episodes) in {out['train_time_s']:.0f} s of training")

# %% [markdown]
# ## How many samples
# The gradient is a likelihood-ratio estimate through the noise of every stochastic step: one decision's advantage
# is spread over $K \times T_a \times A$ Gaussian dims, and the estimate's noise grows with that while its signal
# does not. Here an update sees 5,120 decisions. On this task 256 per update are enough too, at the same env-step
# budget (the sample-size curve), while on PickCube at CPU scale about fifty runs at 256 never beat their start
# ([what we know](../docs/explanations/cpu_scale.md)).

# %% [markdown]
# ## What runs where
#
# | task, size | params | machine | result |
# |---|---|---|---|
# | FastReach, this notebook's defaults | none | CPU, 1-2 min | above |
# | FastReach, the official batch (10k decisions per update) | `params/03_reinflow/fast_reach_mlp.yaml` | CPU, ~1 min of training | 0.487 -> 0.986-0.993 over 3 seeds ([record](../results/fast_tasks/fast_reach_mlp/)) |
# | FastReach, 256 to 16k decisions per update | `params/03_reinflow/sample_size/` | CPU, 4-20 min each | 1.000 to 0.678 at 2.46M env steps ([curve](../docs/fast_tasks.md)) |
# | FastPush, the contact task, 10k decisions per update | `params/03_reinflow/fast_push_mlp.yaml` | CPU, ~4-8 min of training | 0.672 -> 0.984-0.990 over 3 seeds ([record](../results/fast_tasks/fast_push_mlp/)) |
# | either task, the official ReinFlow recipe | `params/03_reinflow/recipe/` | CPU, 6-10 min | about 4x fewer env steps, slower per CPU second ([recipes](../docs/fast_tasks.md)) |
# | Meta-World pick-place, assembly, peg-insert-side | `params/03_reinflow/metaworld_*.yaml` | CPU, 8-38 min each | see the table above ([record](../docs/results/metaworld.md)) |
# | PickCube-v1 at CPU scale (256 decisions per update) | `params/03_reinflow/cpu_dense.yaml` | CPU, 10-60 min | no gain ([what we know](../docs/explanations/cpu_scale.md)) |
# | PickCube-v1, paper size | `params/03_reinflow/baseline.yaml` | GPU with `physx_cuda` | not run: `physx_cuda` cannot load on our machines |
#
# Steering the frozen flow instead (its initial noise, or a residual per env step) is notebook `06_steering`.
