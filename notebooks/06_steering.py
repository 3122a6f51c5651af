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
# # 06 · Steering a frozen flow: its initial noise, a residual per chunk, a residual per env step
#
# **The question.** Notebook 03 fine-tunes the flow's own weights through its noisy chain (ReinFlow). Can something
# small learned *around* a frozen stage-1 flow do as well or better: where its chain starts ($x_0$, DSRL), or a bounded
# correction of the actions it proposes (a residual)? **What the records say** (held-out episodes, paired with the start):
#
# | task | the start | steering the frozen flow | the flow's weights moved (ReinFlow) |
# |---|---|---|---|
# | PickCube-v1, CPU | 0.55-0.63 | per-step residual, TD3: **0.962** over 11 seeds ([stage 3](../docs/results/stage3_pickcube.md)) | no gain in ~50 runs ([why](../docs/explanations/cpu_scale.md)) |
# | Meta-World pick-place | 0.620 | DSRL: **0.995**, one seed ([data](../results/metaworld/pick_place_dsrl/)) | 0.930-0.970, 3 seeds ([data](../results/metaworld/pick_place_cosine/)) |
# | FastPush-v0 | 0.672 | DSRL 0.995-0.998; per-step residual 0.50-0.52 ([fast tasks](../docs/fast_tasks.md#what-the-flow-buys-on-fastpush-and-the-seeds-other-methods-2026-12-03)) | 0.988-0.991 |
#
# Every method is one entry of `flowlib.methods.stage3.METHODS`, a `(steer, learner)` pair trained by the same loop
# (`flowlib.rl.loop.train`) as chain ReinFlow; the sections after the registry's table give each one's math. The
# defaults below steer notebook 01's default clone on `FastReach-v0` by DSRL (PPO on $x_0$, the flow frozen) for 30
# iterations, half a minute on 2 cores (its before and after are printed at the end of the run);
# `params/06_steering/*.yaml` hold the runs of the record (`cpu.yaml`: the per-step residual's PickCube target).

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from flowlib.policies import bc
from flowlib.tools import bench
from flowlib.infra import config, metrics, runs
from flowlib.methods import stage3
from flowlib.envs import visual
from flowlib.envs.maniskill import make_env
from flowlib.infra.tracking import start_run

# %% tags=["parameters"]
# Defaults: DSRL (steer latent, learner ppo) on FastReach-v0 from notebook 01's default clone, 30 iterations (half a
# minute); params/06_steering/cpu.yaml is the per-step residual's ~1 h PickCube target run. Grouped by the dataclass
# that declares them; every parameter a method reads, with its help:
# `python -m flowlib.run 06_steering --show-params residual_step/td3` (any steer/learner).
# RunConfig: every method
seed: int = 0  # the run's seed (nets, noise, minibatches)
init_checkpoint: str = ""  # stage-1/2 best_model.pt, relative to outputs/; "": 01_shortcut_bc/default
env_id: str = "FastReach-v0"  # the task: ManiSkill's, Meta-World's v3 name or a fast torch task (FastReach-v0); the start checkpoint's task
act_horizon: int = 0  # actions executed per chunk decision; 0: the start checkpoint's own
num_envs: int = 512  # parallel envs (processes on physx_cpu)
max_episode_steps: int = 40  # the time limit (a truncation: bootstrapped, not terminal)
backend: str = "auto"  # "auto", "physx_cpu" or "physx_cuda"
reward: str = "sparse"  # "sparse": 1 on success (terminal); "dense": normalized_dense; "shaped": sparse + potential
terminate_on_success: bool = True  # "sparse": a success ends learning's episode; false: it runs on, 1 per solved step [toolkit: no_termination]
reward_scale: float = 1.0  # learning sees reward_scale * r (value targets of O(1)); logged returns are raw
success_bonus: float = 0.0  # reward "dense": added per solved step (learning only)
num_inference_steps: int = 4  # K, the denoising steps of the flow (noisy chain or frozen ODE)
min_noise_std: float = 0.05  # lower bound of the exploration std (of whatever the method draws)
max_noise_std: float = 1.0  # upper bound of the exploration std at the start; decays to final_noise_std
final_noise_std: float = 1.0  # that bound at the end of noise_decay_steps
noise_schedule: str = "constant"  # how the bound decays: "constant", "linear" or "exp"
noise_decay_steps: int = 512  # env steps over which it decays
total_env_steps: int = 1228800  # the run's budget
rollout_steps: int = 10  # decisions per env per iteration (chunks; a per-step residual: chunks of steps)
gamma: float = 0.99  # discount per env step
actor_lr: float = 0.0003  # the policy's learning rate (0: the policy stays as it starts, a control)
critic_lr: float = 0.001  # the value / Q nets' learning rate
lr_schedule: str = "constant"  # both learning rates over the run: "constant" or "cosine" (down to lr_min_ratio)
lr_min_ratio: float = 0.1  # "cosine": the rates end at this share of actor_lr and critic_lr
max_grad_norm: float = 1.0  # gradient-norm clip of every update [toolkit: grad_clip_0.5, grad_clip_off]
obs_clip: float = 5.0  # normalised observations clipped to +-obs_clip (0: off)
critic_warmup_steps: int = 81920  # iterations that start within these env steps update only the critic
value_hidden_dims: list[int] = [256, 256]  # V / Q hidden sizes
warm_start_value: bool = True  # V from a stage-2 checkpoint's critic (same inputs), when there is one
eval_every: int = 10  # iterations between validations (pick best_model.pt); 0: only before and after
num_eval_episodes: int = 512  # episodes per evaluation
val_seed: int = 10000  # env seeds of the validations
eval_seed: int = 20000  # env seeds of the before / after report (never used to pick a model)
train_seed: int = 2000000  # env seeds of training episodes start here
ckpt_every: int = 10  # iterations between last.pt checkpoints
bench_num_envs: list[int] = [512]  # throughput table
bench_decisions: int = 4  # chunk decisions per throughput measurement
num_threads: int = 1  # torch threads (0: torch's default)
resume: bool = True  # go on from the run folder's last.pt when there is one
run_name: str = "default"  # the run folder, outputs/<notebook>/<run_name>
wandb_mode: str = "disabled"  # "disabled", "offline" or "online"
# ShapingConfig: every method, on PickCube-v1 only
reach_weight: float = 0.0  # PickCube, dense / shaped: weight of 1 - tanh(reach_sharpness |cube - tcp|)
reach_sharpness: float = 5.0  # 1/m, of the reach term (ManiSkill's own is 5; 20 pays the last cm)
grasp_min_gap: float = 0.0  # PickCube, dense / shaped: a grasp counts only with fingers at least this far apart (m)
place_weight: float = 0.0  # PickCube, dense / shaped: weight of 1 - tanh(place_sharpness |goal - cube|)
place_sharpness: float = 20.0  # 1/m, of the place term
# MethodChoice: the method
steer: str = "latent"  # what RL moves: "chain", "latent", "residual", "residual_step", "one_step" (FQL), "gaussian"
learner: str = "ppo"  # how: "ppo"; "sac" (latent); "td3" (residual_step); "rfc" (chain); "fql" (one_step)
# ChunkScoreConfig: read by chain/ppo, latent/ppo, residual/ppo, chain/rfc, gaussian/ppo
log_prob_reduce: str = "sum"  # "sum" (the exact joint log-prob), "mean" (over steps), "mean_dim" (per dim)
critic_input: str = "obs"  # V reads "obs" (the window) or "velocity_features" (the velocity net's features) [toolkit: critic_velocity]
detach_critic_input: bool = True  # velocity_features: the value loss does not reach the velocity net [toolkit: critic_velocity_grad]
# PPOConfig: read by chain/ppo, latent/ppo, residual/ppo, residual_step/ppo, chain/rfc, gaussian/ppo
update_epochs: int = 8  # passes over the rollout per update
policy_epochs: int = 0  # epochs of each update that train the policy (0: all); the value fits all
minibatch_size: int = 2048  # decisions per gradient step
micro_batch_size: int = 0  # rows per forward/backward pass in a minibatch (gradient accumulation); 0: all
advantage: str = "gae"  # gae / mc / nstep / grpo / branch (ESTIMATORS) [toolkit: adv_*]
gae_lambda: float = 0.95  # GAE's lambda (advantage "gae")
n_step: int = 5  # decisions, for advantage "nstep" [toolkit: adv_nstep]
group_size: int = 2  # envs per GRPO group (same env seed); num_envs a multiple [toolkit: adv_grpo]
branches: int = 1  # chains tried per decision from one env state (advantage "branch"; physx_cpu)
clip_coef: float = 0.2  # the ratio's clip, 1 +- clip_coef (Schulman et al. 2017, Eq. 7)
dual_clip: float = 0.0  # c > 1 caps the loss of negative-advantage samples at -c A; 0: off [toolkit: dual_clip_3]
value_clip: float = 0.0  # > 0: V clipped to the rollout's values +- this (PPO2); 0: unclipped [toolkit: value_clip_0.2, huber_value_clip]
huber_delta: float = 0.0  # > 0: Huber value loss with this delta; 0: squared [toolkit: huber_value_clip]
ent_coef: float = 0.01  # weight of the entropy bonus
vf_coef: float = 0.5  # weight of the value loss
actor_optimizer: str = "adam"  # "adam", or "sgd": steps along the (norm-clipped) gradient itself
target_kl: float = 0.1  # approx KL past which an update stops early (0: never)
kl_stop: str = "policy"  # past target_kl: "all" ends the update, "policy" keeps fitting the value
adv_norm: str = "batch"  # advantages standardised over the whole batch, per "minibatch", or "off" [toolkit: adv_norm_minibatch, adv_norm_off]
flip_advantages: bool = False  # a control: PPO ascends -A, so a method that learns must get worse
ratio_mode: str = "joint"  # "joint" (one-layer MDP) or "per_step" (two-layer: a ratio per step) [toolkit: ratio_per_step]
reward_scaling: bool = False  # rewards / running std of the discounted return (ReinFlow's, DPPO's)
# RFCMaskConfig: read by chain/ppo, latent/ppo, chain/rfc
rfc_mask: str = "advantage_positive"  # the decisions reflowed: success_only / advantage_positive / advantage_topk [toolkit: rfc_<mask>_<lambda>]
rfc_topk: float = 0.25  # advantage_topk: the share of live decisions kept
# RFCLossConfig: read by chain/ppo, latent/ppo
rfc_lambda: float = 0.0  # weight of the masked reflow loss in PPO's loss (0: off; RLinf's 0.05) [toolkit: rfc_<mask>_<lambda>]
# LatentConfig: read by latent/ppo, latent/sac
latent_bound: float = 2.5  # the bound on |mu(o)| per dim of x_0
latent_hidden_dims: list[int] = [256, 256]  # mu's MLP

# %%
cfg = config.from_globals(stage3.SteeringConfig, globals())
run_path, tracker = start_run("06_steering", cfg)
init_path = stage3.init_checkpoint_path(cfg)
camera = visual.policy_env_kwargs(bc.checkpoint_meta(init_path))  # a visual start's camera; {} for a state policy
env = make_env(cfg.env_id, cfg.num_envs, max_episode_steps=cfg.max_episode_steps, backend=cfg.backend, **camera)
agent, value_init = stage3.build_agent(cfg, init_path, env.spec)
print(f"method {cfg.steer}/{cfg.learner}: {stage3.method(cfg).summary}")
print(f"from {init_path.parent.name}/{init_path.name}; {env.num_envs} env(s) on {env.backend}")

# %% [markdown]
# ## The registered methods
# What each `(steer, learner)` reads beyond the run's own fields: a field of another method is refused.

# %%
pd.DataFrame([{"steer": s, "learner": lr, "method": m.summary, "reads": ", ".join(c.__name__ for c in m.configs)}
              for (s, lr), m in stage3.METHODS.items()])

# %% [markdown]
# ## The methods
#
# **Steering $x_0$** (`steer = "latent"`, `flowlib.methods.latent.LatentSteeringAgent`, DSRL's idea). The flow stays frozen
# and PPO moves a Gaussian policy over the chain's start, $x_0 \sim \mathcal{N}(\mu_\phi(o), \sigma^2 I)$ with
# $|\mu| \le b$; the chain is the ODE. The log-prob has $H \times A$ dims of std $\sim 1$ instead of
# $K \times H \times A$ of std $\sim 0.1$, and re-scoring is one MLP call. At the start ($\mu = 0$) the noisy
# policy is the stage-1 policy; the deterministic one starts the chain at $x_0 = \mu$.
#
# **Learning it off-policy** (`learner = "sac"`, `flowlib.methods.latent_sac`, DSRL's learner). With the flow frozen,
# $w = x_0$ is an action whose dynamics are fixed, so every decision so far can train a twin critic
# $Q_j(o, w)$ on the SMDP target $y = R + \gamma^\tau (1 - \text{term}) \min_j \bar Q_j(o', w')$,
# $w' \sim \pi(\cdot \mid o')$, from a replay buffer. The actor minimises
# $\alpha\,\mathrm{KL}(\pi(\cdot \mid o) \,\|\, \mathcal{N}(0, I))/D - \min_j Q_j(o, \mu + \sigma\epsilon)$: the KL to
# the stage-1 policy's own latent keeps $x_0$ where the flow and the critic have seen data, and $\alpha$ moves so
# that the KL per dim stays at `sac_target_kl`. `critic_warmup_steps` fits $Q$ alone on the stage-1 policy's data.
#
# **Correcting a chunk's executed actions** (`steer = "residual"`, `flowlib.methods.residual`; residual RL, as ResiP and
# Policy Decorator do with diffusion policies). The flow, from its own $x_0 \sim \mathcal{N}(0, I)$, proposes the chunk
# whose executed part is $a_b$; PPO moves a Gaussian correction $r \sim \mathcal{N}(\mu_\phi(o, a_b), \sigma^2 I)$,
# $|\mu| \le b$, and $a = a_b + r$ runs. The log-prob has the $T_a \times A$ dims of $r$ only ($x_0$ does not
# depend on $\phi$ and cancels in the ratio). $\sigma$ must stay small: at $\sigma \approx 0.19$ (5-7 mm per step)
# the stage-1 policy plus the noise alone succeeded in 0.06-0.2 of its training episodes, at 0.05 in about half.

# %% [markdown]
# ### Correcting every step, closed loop
#
# `steer = "residual_step"` (`flowlib.methods.residual_step`; Residual Policy Learning, Silver et al. 2018). The flow
# still re-plans every $T_a$ steps and its chunk runs open loop; at every env step a residual actor
# $r_t = \mu_\phi(o_t, a_b)$, $|r_t| \le b$, corrects the base action due now from the *current* observation, and
# $a_t = a_b + r_t$ runs. Each env step is one transition of an ordinary MDP with state $s_t = (o_t, a_b)$, learned
# off-policy by TD3 (`learner = "td3"`; Fujimoto et al. 2018, Eq. 15; `flowlib.methods.residual_td3.td3_update`): twin
# critics on $y = R_t + \gamma (1 - \text{term}) \min_j \bar Q_j(s', \mathrm{clip}(\bar\mu(s') + \epsilon))$ and the
# deterministic policy gradient $\nabla_\phi Q_1(s, \mu_\phi(s))$ every second critic step. With `td3_n_step`
# $= n > 1$ the target sums $n$ rewards before it bootstraps (Sutton & Barto 2018, Eq. 7.1), so a reward reaches the
# target $n$ steps back at once, at the price of the exploration noise of the $n - 1$ steps after $t$ entering
# $Q(s_t, r_t)$. With `learner = "ppo"` (`flowlib.methods.residual_step_ppo`) the same correction is learned
# on-policy: $r_t \sim \mathcal N(\mu_\phi(s_t), \sigma^2 I)$ unclipped, a state value $V_\psi(s_t)$, GAE over env
# steps, every env step a PPO decision whose log-prob has the arm's 3 dims.
#
# **Why per step, and why TD3.** The stage-1 policy grasps the cube in 0.90 of held-out episodes but places it in
# 0.58, hovering centimetres from the goal; a hand-written per-step nudge towards the goal while grasped lifts it to
# 0.88 on the same 200 episodes. `params/06_steering/cpu.yaml` (TD3, dense reach, grasp-gap and place terms) takes
# stage 1 from ~0.6 to 0.96 over eleven seeds in 311k env steps, about an hour on 2 cores; the same residual chosen
# once per chunk loses ([the record](../docs/stage3.md#the-target-run-a-per-step-residual-on-the-frozen-flow-learned-by-td3)).
# PPO on the per-step residual gets there too (`params/06_steering/cpu_step_ppo.yaml`: 0.962 over three seeds) at
# 1.02M env steps, 5-8x TD3's budget: `benchmarks/gradient_snr.py` finds no signal in PPO's likelihood-ratio gradient in
# 65k decisions at 311k env steps, where TD3's deterministic gradient (`residual_td3.actor_loss`, no sampled noise of
# its own) is detected in 5k-18k, and TD3 takes 8x as many steps per env step from its replay
# ([the record](../docs/stage3.md#the-same-residual-learned-by-ppo-slower-and-it-gets-there)).

# %% [markdown]
# ### The comparison's other rows
#
# `flowlib.methods.rfc`, `flowlib.methods.fql`, `flowlib.methods.gaussian` ask what the flow and its fine-tuning buy.
# RFC (`steer = "chain"`, `learner = "rfc"`) rolls out the noisy chain as ReinFlow does, keeps the decisions a mask
# picks (`rfc_mask`: the episode succeeded, $A > 0$, or the top share by $A$), and trains the flow on their chunks
# with stage 1's ShortCut loss: no ratio, no likelihood. Where a mask keeps few decisions per rollout,
# `rfc_buffer`, `rfc_min_kept` and `rfc_demo_fraction` remember them over iterations, wait for a minibatch and mix
# the start's demos in (`params/06_steering/pickcube_rfc_anchored/`). Beside PPO instead (RLinf's `ppo_rfc`),
# `rfc_lambda` adds the masked loss to PPO's, $L = L_{PPO} + \lambda \sum_i m_i \ell_i / \sum_i m_i$
# (`flowlib.methods.rfc.RFCRegulariser`), on the chain or on DSRL's $x_0$ policy, whose frozen flow it then trains
# in the same run ([the toolkit's rows](../docs/results/toolkit.md)). FQL (`steer = "one_step"`, `learner = "fql"`)
# distils the frozen flow into a one-step policy $\mu_\omega(s, z)$ pushed up a critic,
# $-Q(s, \mu_\omega(s, z))/|Q| + \alpha\,|\mu_\omega(s, z) - \mu_\theta(s, z)|^2$, offline on the demos (the "before"
# row), then online from a replay seeded with them. The Gaussian baseline (`steer = "gaussian"`) has no flow at all:
# an MLP mean cloned from the same demos, fine-tuned by the same PPO. Their runs on the fast contact task are
# `params/06_steering/fast_push_*.yaml`
# ([the record](../docs/fast_tasks.md#what-the-flow-buys-on-fastpush-and-the-seeds-other-methods-2026-12-03)).

# %% [markdown]
# ## Before: the deterministic agent on held-out seeds
# Every steering head's last layer starts at zero, so before any update a residual agent runs the stage-1 policy's
# chunks unchanged, and a latent agent starts every chain at $x_0 = \mu = 0$.

# %%
before = bc.evaluate(agent, env, cfg.num_eval_episodes, cfg.num_inference_steps, seed=cfg.eval_seed)
print(f"before fine-tuning: success_once {before['success_once']:.2f}, success_at_end {before['success_at_end']:.2f} "
      f"({before['episodes']} episodes, seeds {cfg.eval_seed}+)")

# %% [markdown]
# ## Fine-tuning
# The loop of `flowlib.rl.loop.train` with this method's learner: collect, update (the critic alone in the warm-up),
# validate, checkpoint. A killed run resumes from `last.pt`, replay buffer included.

# %%
out = stage3.train(cfg, agent, env, run_path, tracker)
history = pd.DataFrame(tracker.rows)
print(f"{out['iterations']} iterations, {out['env_steps']} env steps in {out['train_time_s']:.0f}s")
history.filter(["step", "iteration", "critic_warmup", "updates", "value_loss", "policy_loss", "q",
                "train/success_once"]).round(4).tail(8)

# %%
# NBVAL_CHECK_OUTPUT
print(f"env-step budget met: {out['env_steps'] >= cfg.total_env_steps}")
losses = [row["value_loss"] for row in tracker.rows if "value_loss" in row]
print(f"no NaN in the losses: {bool(losses) and bool(np.isfinite(losses).all())}")

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3))
for col, ax in zip(["train/success_once", "value_loss", "policy_loss"], axes):
    if col in history:
        ax.plot(history["step"], history[col], marker=".")
    ax.set_xlabel("env steps")
    ax.set_ylabel(col)
    ax.set_title(col)
fig.suptitle(f"{cfg.steer}/{cfg.learner} on {cfg.env_id}: training")
fig.tight_layout()
runs.save_figure(fig, run_path, "learning_curve")
plt.show()

# %% [markdown]
# ## After: the same episodes, and the policy's share of an env step

# %%
after = bc.evaluate(agent, env, cfg.num_eval_episodes, cfg.num_inference_steps, seed=cfg.eval_seed)
compare = pd.DataFrame(metrics.before_after({"before": before, "after": after}))
compare.to_csv(run_path / "before_after.csv", index=False)
env.close()
overheads = bench.overhead_table(agent, cfg, **camera)
compare.round(3)

# %%
summary = {"method": f"{cfg.steer}/{cfg.learner}", "init_checkpoint": str(init_path), "env_steps": out["env_steps"],
           "train_time_s": out["train_time_s"], "before": {k: before[k] for k in ("success_once", "success_at_end")},
           "after": {k: after[k] for k in ("success_once", "success_at_end")}, "best": out["best"],
           "overhead_fraction": [row["overhead_fraction"] for row in overheads]}
tracker.summary(summary)
tracker.finish()
print(f"success_once {before['success_once']:.2f} -> {after['success_once']:.2f} after {out['env_steps']} env steps "
      f"({out['train_time_s']:.0f}s); policy share of an env step {overheads[0]['overhead_fraction']:.2f}")

# %%
# NBVAL_CHECK_OUTPUT
paired = metrics.paired_means({"before": before["per_episode_success_once"], "after": after["per_episode_success_once"]})[1]
print(f"a gain beyond 2 SE, paired on the same {paired['episodes']} episodes: {paired['diff'] > 2 * paired['diff_se']}")
