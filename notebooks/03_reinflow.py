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
# # 03 · Stage 3: ReinFlow, online PPO fine-tuning of the flow policy through its denoising chain
#
# Stages 1 and 2 learned from fixed data. Stage 3 lets the policy act in the simulator and improves
# it by policy gradient. A flow policy has no tractable likelihood for its action, so ReinFlow
# (Zhang et al. 2025) makes the **denoising chain itself** the object of the policy gradient.
#
# **The denoising MDP.** With $K$ steps on the grid $t_k = k/K$ (the one `flowlib.flows.time_grid`),
# the sampler becomes a Markov chain by adding learned noise at every step (ReinFlow Eq. 4):
# $$x_{k+1} = x_k + v_\theta(x_k, t_k \mid o)\,\tfrac1K + \sigma_\theta(t_k, o)\,\epsilon_k,\qquad \epsilon_k\sim\mathcal N(0, I),$$
# so each transition is Gaussian and the chain has an **exact** log-likelihood (ReinFlow Eq. 5):
# $$\log\pi_\theta(x_{0:K}\mid o) = \sum_{k=0}^{K-1}\log\mathcal N\big(x_{k+1};\, x_k + v_\theta(x_k,t_k\mid o)/K,\ \sigma_\theta(t_k,o)^2 I\big)
#   \;\big[+\log\mathcal N(x_0; 0, I)\big].$$
# The sum runs over all $H \times A$ dims of each step (`log_prob_over = "chunk"`). Only $T_a$ of the $H$
# actions of $x_K$ are executed, and the others reach nothing, so their score has zero mean: dropping them
# *at the last step* keeps the gradient exact and lowers its variance (`"executed_last"`). At an earlier step
# the non-executed dims of $x_{k+1}$ feed the U-Net's next velocity of the executed ones, so keeping only
# the executed dims at every step (`"executed"`, used by our first CPU runs) drops part of the gradient: it
# is biased. With the whole $16 \times 4$ chunk, one Adam step at lr $10^{-4}$ moved the chain's KL by 0.66
# in our pilot, so the actor's learning rate is small.
# $\sigma_\theta$ is a small network (`ExploreNoiseNet`) squashed into $[\sigma_\min, \sigma_\max]$;
# $\sigma_\max$ decays during training. The executed chunk is $x_K$; evaluation drops the noise.
# PPO moves $v_\theta$ and $\sigma_\theta$. A stage-1 policy trained with `obs_emb_dim` > 0 reads $o$ through an
# `obs_encoder` (an MLP; for pixels it would be a pretrained visual encoder), and `freeze_obs_encoder` keeps that
# part of $v_\theta$ as stage 1/2 left it.
#
# **PPO on chains.** The ratio is $\rho = \exp(\log\pi_\theta(x_{0:K}\mid o) - \log\pi_{\theta_\text{old}}(x_{0:K}\mid o))$,
# with the clipped surrogate $\mathbb E[\min(\rho A, \operatorname{clip}(\rho, 1\pm\epsilon)A)]$
# (Schulman et al. 2017, Eq. 7). Before any update $\rho$ must be exactly 1: re-scoring on another
# time grid than sampling (a known bug in a public implementation) breaks that, and `ppo_update`
# checks it on every update.
#
# **A per-dim ratio.** With $D$ scored Gaussian dims, $\rho$ is a product of $D$ per-dim ratios, so a clip of
# $\epsilon = 0.2$ on it bounds the average per-dim log-ratio to about $0.2/D$ ($D = 224$ at $K = 4$ with
# `"executed_last"`). ReinFlow's public code divides the chain's log-prob by the number of dims it scores and
# clips at $\epsilon = 0.01$ (DPPO's value for state inputs): $\bar\rho = \exp\big(\tfrac1D(\log\pi_\theta - \log\pi_{\theta_\text{old}})\big)$,
# the geometric mean of the per-dim ratios (`log_prob_reduce = "mean_dim"`). At $\bar\rho = 1$ its gradient
# is the policy gradient divided by $D$, which Adam's step size ignores; what changes is the trust region.
#
# **Correlated exploration.** $\epsilon_k$ is independent over the chunk's $H$ actions, so at the CPU noise
# levels each executed action jitters by ~2 mm and the next chunk corrects it. With `noise_corr` $= \rho$, each
# action dim's noise is equicorrelated along the chunk, $\operatorname{Cov} = \sigma^2((1-\rho)I + \rho\,\mathbf 1\mathbf 1^\top)$,
# so a chunk moves as a whole; its log-density stays closed-form (Sherman-Morrison, `flow_sde.gaussian_log_prob`).
#
# **Chunks as a semi-MDP.** A decision at $s_c$ executes $T_a$ actions, earning
# $R_c = \sum_{k<\tau}\gamma^k r_{c+k}$ over the $\tau \le T_a$ steps that ran. Then
# $$\delta_c = R_c + \gamma^{\tau}(1-\text{term}_c)\,V(s_{c+\tau}) - V(s_c),\qquad
#   A_c = \delta_c + \gamma^{\tau}\lambda\,(1-\text{end}_c)\,A_{c+1}$$
# (GAE, Schulman et al. 2016, Eq. 16, with the per-decision discount $\gamma^\tau$). A termination
# (success, with the sparse reward) stops the bootstrap; a time-limit truncation bootstraps from
# $V$ of the last observation. $T_a$ is the checkpoint's own unless `act_horizon` sets it: fewer actions
# per decision re-plan more often, with more decisions per env step and fewer dims in each log-prob.
#
# **Critic warm-up.** The value net starts from scratch (or from the stage-2 $V$): for the first
# `critic_warmup_steps` env steps only it learns, so the first policy updates see sane advantages. Updates come
# once per iteration, so the warm-up is every iteration that *starts* within those steps:
# ceil(N / env steps per iteration) iterations.
#
# **Observation clipping.** The nets see observations normalised by the demonstrations' mean and std. Some
# dims barely move in the demos (the tilt of the cube and of the gripper: std 0.0003-0.004), so a rollout
# that tips the cube puts them at 100+ std. There the value net extrapolates to $|V| \sim 10^4$, and its
# bootstrapped targets wreck the critic and, through the advantages, the policy (our first 1M-step CPU run
# collapsed this way). `obs_clip` clips the normalised observation to $\pm 5$ for the flow, noise and value
# nets (the demos lie within $\pm 7.2$).
#
# **Reward.** `reward = "sparse"` pays 1 on success, which ends the episode; `"dense"` is ManiSkill's
# `normalized_dense` (reach, grasp, place, stay still; 1 at success) and episodes run to the time limit.
# Dense 100-step returns are ~30-40, so `reward_scale` shrinks what learning sees to value targets of
# O(1) (unscaled, the critic's explained variance stayed near 0 in our pilot); logged returns stay raw.
# `"shaped"` is the sparse reward plus $\gamma \phi(s') - \phi(s)$ with the dense reward as the potential
# $\phi$ (Ng et al. 1999, Thm. 1): the same best policies as the sparse reward, with the dense one's guidance.
# That guidance is transient: for every policy $Q^\pi_{\rm shaped}(s, a) = Q^\pi_{\rm sparse}(s, a) - \phi(s)$
# (the shaping terms telescope), so a critic fitted to its fixed point has the sparse reward's action-gradient,
# which at $\gamma = 0.8$ per step fades as $0.8^n$ with the $n$ steps to success: the grasp, 20-30 steps
# before success, gets none of it. With `"dense"`, $Q = \mathbb{E}\sum_t \gamma^t \phi(s_{t+1})$ keeps a
# $1/(1-\gamma)$-step look-ahead at $\phi$, and success (1 per step) is worth staying in.
# (Dense returns can rise while success falls: carrying the cube near the goal without succeeding earns
# 0.5-0.8 per step against success's 1, and a fine-tuned policy learned just that; see docs/stage3.md.)
# `success_bonus` $B$ (dense only) adds $B$ per solved step to what learning sees, so success earns $1 + B$.
# `reach_weight` $w$ (PickCube) adds $w \cdot \mathrm{reach}(s')$, ManiSkill's reaching term
# $1 - \tanh(5\,\lVert p_{\rm cube} - p_{\rm gripper}\rVert)$ (1 once grasped), to the dense reward or to the
# shaped reward's potential: the dense reward pays only $\mathrm{reach}/5$ for the approach, a few thousandths
# per step for closing in on a cube the gripper is about to miss (`reach_sharpness` $k_r$ replaces the 5 of
# the added term only: at $k_r = 20$, `cpu.yaml`'s, the last 3 cm pay 0.5 of it). ManiSkill's `is_grasped` reads
# contact forces, so it also fires while the fingers squeeze an edge of the cube and slide off it;
# `grasp_min_gap` $g$ counts it (in the dense reward's grasp and place terms and in the reach term) only while the
# fingers are $\geq g$ apart, across the 4 cm cube, and pays a squeeze on the edge $\mathrm{reach}/5$, as for the
# approach.
# `place_weight` $w_p$ adds $w_p\,(1 - \tanh(k\,\lVert p_{\rm goal} - p_{\rm cube}\rVert))$ while the grasp counts
# ($k$ = `place_sharpness`, 20/m): the dense reward's own place term, $(1 - \tanh(5 d))/5$, pays about 0.01 per
# step for a centimetre, which a critic does not tell apart from its noise when the cube hangs 3 cm above the goal;
# at $k = 20$ each of the last five centimetres pays 0.1-0.2.
#
# **Why it needs many samples.** The gradient is a likelihood-ratio estimate through the noise of every
# stochastic step: with $K = 4$ and $8 \times 4$ executed dims, one decision's advantage is spread over
# 128 Gaussian dims. The estimate's noise grows with that dimension while its signal does not, and a
# 128-dim ratio leaves $[1-\epsilon, 1+\epsilon]$ after the mean moves by only about $\epsilon\sigma/\sqrt{128}$
# per dim. `tests/test_ppo.py` checks the machinery on a one-step bandit (the reward rises, and flipping
# the advantage lowers it); DPPO and ReinFlow feed it thousands of decisions per update on a GPU.
#
# **Steering the frozen flow instead** (x_0, a residual per chunk or per env step, by PPO, SAC or TD3) is
# notebook `06_steering`: the same loop, other methods of `flowlib.stage3.METHODS`.


# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from flowlib import bc, bench, config, loop, metrics, runs, stage3
from flowlib.envs import make_env
from flowlib.tracking import start_run

# %% tags=["parameters"]
# Defaults: a short CPU run from notebook 01's default checkpoint (minutes; it shows the machinery,
# not a better policy). params/03_reinflow/cpu_ppo.yaml is the ~1 h PPO run through the chain on 2 cores,
# baseline.yaml the paper-size one (GPU).
seed: int = 0  # the run's seed (nets, noise, minibatches)
init_checkpoint: str = ""  # stage-1/2 best_model.pt, relative to outputs/; "": 01_shortcut_bc/default
env_id: str = "PickCube-v1"  # the ManiSkill task; must be the start checkpoint's
act_horizon: int = 0  # actions executed per chunk decision; 0: the start checkpoint's own
num_envs: int = 2  # parallel envs (processes on physx_cpu)
max_episode_steps: int = 100  # the time limit (a truncation: bootstrapped, not terminal)
backend: str = "auto"  # "auto", "physx_cpu" or "physx_cuda"
reward: str = "sparse"  # "sparse": 1 on success (terminal); "dense": normalized_dense; "shaped": sparse + potential
reward_scale: float = 1.0  # learning sees reward_scale * r (value targets of O(1)); logged returns are raw
success_bonus: float = 0.0  # reward "dense": added per solved step (learning only)
reach_weight: float = 0.0  # PickCube, dense / shaped: weight of 1 - tanh(reach_sharpness |cube - tcp|)
reach_sharpness: float = 5.0  # 1/m, of the reach term (ManiSkill's own is 5; 20 pays the last cm)
grasp_min_gap: float = 0.0  # PickCube, dense / shaped: a grasp counts only with fingers at least this far apart (m)
place_weight: float = 0.0  # PickCube, dense / shaped: weight of 1 - tanh(place_sharpness |goal - cube|)
place_sharpness: float = 20.0  # 1/m, of the place term
num_inference_steps: int = 8  # K, the denoising steps of the flow (noisy chain or frozen ODE)
min_noise_std: float = 0.01  # lower bound of the exploration std (of whatever the method draws)
max_noise_std: float = 0.3  # upper bound of the exploration std at the start; decays to final_noise_std
final_noise_std: float = 0.01  # that bound at the end of noise_decay_steps
noise_schedule: str = "linear"  # how the bound decays: "constant", "linear" or "exp"
noise_decay_steps: int = 512  # env steps over which it decays
include_initial_noise: bool = False  # log N(x_0; 0, I) in the joint log-prob (flow_noise always has it)
log_prob_over: str = "chunk"  # the dims each step scores: "chunk" / "executed_last" (exact) or "executed"
freeze_obs_encoder: bool = False  # keep the velocity net's obs_encoder (stage 1's obs_emb_dim > 0) fixed
noise_method: str = "reinflow"  # reinflow / flow_noise (learned std) / flow_sde / flow_cps (noise_level a)
noise_level: float = 0.5  # a of flow_sde / flow_cps; scaled by the noise schedule like max_noise_std
hybrid: bool = False  # one random stochastic step per sample, the rest ODE (piRL's hybrid ODE-SDE)
log_prob_reduce: str = "sum"  # "sum" (the exact joint log-prob), "mean" (over steps), "mean_dim" (per dim)
ratio_mode: str = "joint"  # "joint" (one-layer MDP) or "per_step" (two-layer MDP: a ratio per step)
critic_input: str = "obs"  # V reads "obs" (the window) or "velocity_features" (the velocity net's features)
detach_critic_input: bool = True  # velocity_features: the value loss does not reach the velocity net
total_env_steps: int = 512  # the run's budget
rollout_steps: int = 8  # decisions per env per iteration (chunks; a per-step residual: chunks of steps)
update_epochs: int = 2  # passes over the rollout per update
policy_epochs: int = 0  # epochs of each update that train the policy (0: all); the value fits all
minibatch_size: int = 16  # decisions per gradient step
micro_batch_size: int = 0  # rows per forward/backward pass in a minibatch (gradient accumulation); 0: all
gamma: float = 0.99  # discount per env step
advantage: str = "gae"  # gae / mc / nstep / grpo / branch (ESTIMATORS)
gae_lambda: float = 0.95  # GAE's lambda (advantage "gae")
n_step: int = 5  # decisions, for advantage "nstep"
group_size: int = 2  # envs per GRPO group (same env seed); num_envs must be a multiple
branches: int = 1  # chains tried per decision from one env state (advantage "branch"; physx_cpu)
clip_coef: float = 0.2  # the ratio's clip, 1 +- clip_coef (Schulman et al. 2017, Eq. 7)
dual_clip: float = 0.0  # c > 1 caps the loss of negative-advantage samples at -c A; 0: off
value_clip: float = 0.0  # 0: unclipped value loss
huber_delta: float = 0.0  # > 0: Huber value loss with this delta; 0: squared error
ent_coef: float = 0.01  # weight of the entropy bonus
vf_coef: float = 0.5  # weight of the value loss
actor_lr: float = 3e-05  # the policy's learning rate (0: the policy stays as it starts, a control)
actor_optimizer: str = "adam"  # "adam", or "sgd": steps along the (norm-clipped) gradient itself
critic_lr: float = 0.0001  # the value / Q nets' learning rate
max_grad_norm: float = 1.0  # gradient-norm clip of every update
target_kl: float = 0.0  # 0: no early stop
kl_stop: str = "all"  # past target_kl: "all" ends the update, "policy" keeps fitting the value
norm_adv: bool = True  # advantages normalised per minibatch
obs_clip: float = 5.0  # normalised observations clipped to +-obs_clip (0: off)
noise_corr: float = 0.0  # correlation of a step's noise along the chunk's H actions, in [0, 1)
critic_warmup_steps: int = 128  # iterations that start within these env steps update only the critic
value_hidden_dims: list[int] = [256, 256]  # V / Q hidden sizes
warm_start_value: bool = True  # V from a stage-2 checkpoint's critic (same inputs), when there is one
eval_every: int = 0  # iterations between validations (pick best_model.pt); 0: only before and after
num_eval_episodes: int = 4  # episodes per evaluation
val_seed: int = 10000  # env seeds of the validations
eval_seed: int = 20000  # env seeds of the before / after report (never used to pick a model)
train_seed: int = 2000000  # env seeds of training episodes start here
ckpt_every: int = 1  # iterations between last.pt checkpoints
bench_num_envs: list[int] = [1, 2]  # throughput table
bench_decisions: int = 8  # chunk decisions per throughput measurement
num_threads: int = 1  # torch threads (0: torch's default)
resume: bool = True  # go on from the run folder's last.pt when there is one
run_name: str = "default"  # the run folder, outputs/<notebook>/<run_name>
wandb_mode: str = "disabled"  # "disabled", "offline" or "online"

# %%
cfg = config.from_globals(stage3.Stage3Config, globals())
run_path, tracker = start_run("03_reinflow", cfg)
init_path = stage3.init_checkpoint_path(cfg)
env = make_env(cfg.env_id, cfg.num_envs, max_episode_steps=cfg.max_episode_steps, backend=cfg.backend)
agent, value_init = stage3.build_agent(cfg, init_path, env.spec)
print(f"run folder: {runs.shown(run_path)}; from {init_path.parent.name}/{init_path.name}; "
      f"V: {value_init}; {env.num_envs} env(s) on {env.backend}")

# %% [markdown]
# ## The chain, its log-probability, and the ratio before an update
# One noisy chain for a batch of observations: sampled once, then re-scored by the training code
# path. Same weights, same grid: the ratio must be 1.

# %%
obs = env.reset(seed=cfg.eval_seed)
window = obs[:, None].repeat(1, agent.obs_horizon, 1)
chain, log_prob = agent.sample(window, torch.Generator().manual_seed(cfg.seed))
with torch.no_grad():
    rescored, entropy = agent.log_prob(window, chain)
ratio = (rescored - log_prob).exp()
print(f"chain {tuple(chain.shape)} = [B, K+1, H, A]; log-prob per chain {log_prob.numpy().round(1)}")

# %%
# NBVAL_CHECK_OUTPUT
print(f"chain has K+1 = {cfg.num_inference_steps + 1} states: {chain.shape[1] == cfg.num_inference_steps + 1}")
print(f"ratio == 1 before any update: {bool((ratio - 1).abs().max() < 1e-4)}")

# %% [markdown]
# ## Before: the deterministic chain on held-out seeds

# %%
before = bc.evaluate(agent, env, cfg.num_eval_episodes, cfg.num_inference_steps, seed=cfg.eval_seed)
print(f"before fine-tuning: success_once {before['success_once']:.2f}, success_at_end {before['success_at_end']:.2f} "
      f"({before['episodes']} episodes, seeds {cfg.eval_seed}+)")

# %% [markdown]
# ## Fine-tuning
# Each iteration collects `rollout_steps` decisions per env with the noisy chain, computes SMDP
# GAE, and runs PPO (value net only during the warm-up). `last.pt` after every `ckpt_every`
# iterations: a killed run resumes where it stopped.

# %%
out = stage3.train(cfg, agent, env, run_path, tracker)
history = pd.DataFrame(tracker.rows)
print(f"{out['iterations']} iterations, {out['env_steps']} env steps in {out['train_time_s']:.0f}s")
history.filter(["step", "iteration", "critic_warmup", "max_noise_std", "value_loss", "policy_loss", "approx_kl",
                "clip_frac", "explained_variance", "train/success_once"]).round(4).tail(8)

# %%
# NBVAL_CHECK_OUTPUT
print(f"env-step budget met: {out['env_steps'] >= cfg.total_env_steps}")
print(f"critic warm-up first, then policy updates: {bool(history.critic_warmup.iloc[0] == 1) and 'policy_loss' in history}")
losses = [row["value_loss"] for row in tracker.rows if "value_loss" in row]  # SAC: none until a batch is stored
print(f"no NaN in the losses: {bool(losses) and bool(np.isfinite(losses).all())}")

# %% [markdown]
# ## Learning curves, against env steps and wall time

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3))
for col, ax in zip(["train/success_once", "value_loss", "policy_loss"], axes):
    if col in history:
        ax.plot(history["step"], history[col], marker=".")
    ax.set_xlabel("env steps")
    ax.set_ylabel(col.split("/")[-1])
    ax.set_title(col)
ax2 = axes[0].twiny()
ax2.set_xlim(history["wall_time"].min(), history["wall_time"].max())
ax2.set_xlabel("wall time (s)")
fig.tight_layout()
runs.save_figure(fig, run_path, "learning_curve")
plt.show()

# %% [markdown]
# ## After: the same seeds
# With PickCube's other evaluation flags, each true at some step of an episode: how many episodes grasp the
# cube (`is_grasped_once`) and bring it to the goal (`is_obj_placed_once`) on the way to success.

# %%
after = bc.evaluate(agent, env, cfg.num_eval_episodes, cfg.num_inference_steps, seed=cfg.eval_seed)
compare = pd.DataFrame(metrics.before_after({"before": before, "after": after}))
compare.to_csv(run_path / "before_after.csv", index=False)
compare.round(3)

# %%
# NBVAL_CHECK_OUTPUT
print(f"same {cfg.num_eval_episodes} evaluation episodes before and after: {before['episodes'] == after['episodes']}")

# %% [markdown]
# ## The exploration-noise schedule
# Planned $\sigma_\max$ over the env-step budget, and the noise the net actually used (geometric mean
# of $\sigma_\theta$ over the batch, from the Gaussian entropy).

# %%
steps = np.linspace(0, max(cfg.total_env_steps, cfg.noise_decay_steps), 200)
planned = [loop.noise_schedule(cfg.noise_schedule, s / cfg.noise_decay_steps, cfg.max_noise_std, cfg.final_noise_std)
           for s in steps]
fig, ax = plt.subplots(figsize=(5, 2.8))
ax.plot(steps, planned, label=f"max_noise_std ({cfg.noise_schedule})")
if "noise_std" in history:
    ax.plot(history["step"], history["noise_std"], "o", label="noise std used")
ax.set_xlabel("env steps")
ax.set_ylabel("std (normalised actions)")
ax.legend()
runs.save_figure(fig, run_path, "noise_schedule")
plt.show()

# %% [markdown]
# ## Where the time goes, and the policy's overhead
# Per iteration: rollout (simulator + chain sampling) against PPO update. Then the policy's share of
# an env step (noisy chain for the batch, value, bookkeeping, divided by $N \cdot T_a$ env steps)
# against a raw simulator step, and throughput over the number of envs.

# %%
phase = history[["rollout_time", "update_time"]].sum()
print(f"rollout {phase.rollout_time:.1f}s ({phase.rollout_time / phase.sum():.0%}), update {phase.update_time:.1f}s")
env.close()
overheads = pd.DataFrame(bench.overhead_table(agent, cfg))
runs.save_json(run_path / "benchmark.json", {"K": cfg.num_inference_steps, "rows": overheads.to_dict("records")})
overheads.round(3)

# %%
# NBVAL_CHECK_OUTPUT
print(f"benchmark rows for num_envs {cfg.bench_num_envs}: {overheads.num_envs.tolist() == cfg.bench_num_envs}")

# %%
summary = {"init_checkpoint": str(init_path), "value_init": value_init, "env_steps": out["env_steps"],
           "train_time_s": out["train_time_s"], "before": {k: before[k] for k in ("success_once", "success_at_end")},
           "after": {k: after[k] for k in ("success_once", "success_at_end")}, "best": out["best"],
           "overhead_fraction": overheads.overhead_fraction.tolist()}
tracker.summary(summary)
tracker.finish()
print(f"success_once {before['success_once']:.2f} -> {after['success_once']:.2f} after {out['env_steps']} env steps "
      f"({out['train_time_s']:.0f}s)")

# %% [markdown]
# ## Is an update signal or noise?
# One PPO minibatch starts at ratio 1, so its gradient is the likelihood-ratio estimate
# $G = -\frac{1}{B}\sum_i A_i \nabla_\theta \log \pi_\theta(\text{chain}_i \mid s_i)$
# (`reinflow.policy_gradient`). Write $G_j = \mu + e_j$ for independent estimates (one env's rollout each),
# with $\mathbb{E}\,e_j = 0$ and $\mathbb{E}\,|e_j|^2 = s$. Their Gram matrix $M = G G^\top$ has
# $\mathbb{E}\,M_{ij} = |\mu|^2$ off the diagonal and $|\mu|^2 + s$ on it, so the mean off-diagonal entry estimates
# the signal $|\mu|^2$ without bias (`ppo.gram_signal`). Two independent means of $m$ estimates then meet at a cosine
# of about $|\mu|^2 / (|\mu|^2 + s/m)$: the update points along the expected gradient only once
# $m \gtrsim s / |\mu|^2$.
#
# `benchmarks/gradient_snr.py` measures this on a fine-tuned checkpoint. For the velocity net on 2 cores
# (docs/stage3.md), no sampling setting shows a signal beyond 2 standard errors in 8k-33k decisions: a
# 256-decision iteration has a cosine of at most ~0.01-0.02 with the expected gradient, and half-clear updates need
# more than 15k-28k decisions each. The noise $s$ falls as $1/\sigma^2$ with the exploration std $\sigma$, since each
# score term carries $\varepsilon / \sigma$.
#
# The same script measures the per-step residual of notebook `06_steering`, where TD3's gradient does carry signal.
