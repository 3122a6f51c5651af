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
# # 02 · Stage 2: offline RL from demos and rollouts, AW-ShortCut against RFC's masks and FQL
#
# Stage 1 cloned the demonstrations. Stage 2 improves the policy **from data alone**: it re-trains
# the same ShortCut flow with each (observation, action chunk) weighted by how much better that chunk
# is than the policy's average, as judged by a critic learned offline.
#
# **Advantage-weighted regression** (AWR, Peng et al. 2019; AWAC, Nair et al. 2020). The policy
# that maximises $\mathbb E[A]$ while staying close (in KL) to the data's behaviour policy
# $\pi_\beta$ is $\pi^*(a\mid s) \propto \pi_\beta(a\mid s)\exp(\beta A(s,a))$ (AWR Eq. 7). Fitting
# it by maximum likelihood on data from $\pi_\beta$ means weighting each sample by
# $w = \exp(\beta A)$, clipped at $w_\max$ for stability (`flowlib.policies.critic.advantage_weights`). For a flow policy, the "likelihood" is
# the ShortCut loss: the whole per-sample loss (flow-matching *and* self-consistency parts) is
# multiplied by $w$, so both describe the same re-weighted distribution (`flowlib.policies.awsc`).
#
# **The critic lives on chunks** (a semi-MDP). A chunk of $T_a$ actions from $s_c$ runs
# $\tau = \min(T_a, T - c)$ steps and gives
# $$R = \sum_{k<\tau}\gamma^k r_{c+k}, \qquad Q(s_c, a_{c:c+T_a}) \leftarrow R + \gamma^\tau (1 - \text{terminal})\, V(s_{c+\tau}).$$
# A time-limit truncation is not a termination: it bootstraps (`flowlib.policies.critic.chunk_transitions`).
#
# **IQL** (Kostrikov et al. 2022) fits $V$ without ever querying actions outside the data, by
# *expectile regression* on $Q$ (IQL Eq. 5; `flowlib.policies.critic.expectile_loss`):
# $$L_V = \mathbb E\big[\,|\kappa - \mathbb 1(u<0)|\, u^2\big], \quad u = \min_i Q_{\bar\theta_i}(s,a) - V(s),$$
# which for $\kappa > 0.5$ approaches the best value among in-data actions; twin $Q$ nets regress on
# the SMDP target (IQL Eq. 6) with Polyak-averaged copies. The advantage is $A = \min_i Q_{\bar\theta_i} - V$.
# A Monte-Carlo critic ($V$ regressed on observed returns, $A = G - V$) is the simple baseline.
#
# **Data with contrast.** Demos that (nearly) all succeed, motion-planned or scripted, give a critic trained on
# them alone nothing to rank. We add rollouts of the stage-1 policy (deterministic and with exploration noise,
# successes and failures) recorded in the simulator. Every episode stops at its first success,
# which is terminal (the sparse reward is 1 there, 0 elsewhere).
#
# **The same data, two other answers.** AW-ShortCut is one way to improve a policy from fixed data. The notebook
# runs two more on the very same episodes and scores all of them on the same held-out seeds: RFC's masks (keep
# some windows, drop the rest, the same loss) and FQL's offline phase (a one-step policy pushed up a Q-function,
# held near the flow). Stage 3 takes up where this stops: the same methods online, with fresh rollouts.
#
# **By default** the task is `FastReach-v0`, from notebook 01's default clone (about 0.5), its 1,000 demos and 400 of its
# rollouts: every method is scored on the same 500 held-out episodes, paired with stage 1, in a minute or two.
# PickCube: `params/02_aw_shortcut/cpu.yaml`; FastPush over 3 training seeds: `fast_push_mlp.yaml`; Meta-World:
# `metaworld_*.yaml` ([stage 2's record](../docs/results/stage2_aw_shortcut.md)).

# %%
import dataclasses
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from flowlib.policies import awsc, bc, critic as critics
from flowlib.infra import config, runs
from flowlib.tools import evaluate
from flowlib.methods import fql
from flowlib.envs.data import ChunkDataset, check_held_out, generate_demos, load_demos
from flowlib.envs.maniskill import is_fast, make_env
from flowlib.infra.tracking import start_run

# %% tags=["parameters"]
# Defaults: the small CPU run (a minute or two), FastReach-v0 from notebook 01's default checkpoint.
# Longer runs: params/02_aw_shortcut/cpu.yaml (PickCube, 2 CPU cores), gpu.yaml, fast_push_mlp.yaml, metaworld_*.yaml.
seed: int = 0  # seed of torch and of the run's random draws
stage1_checkpoint: str = ""  # relative to outputs/; "" means 01_shortcut_bc/default/best_model.pt
env_id: str = "FastReach-v0"  # the task: a ManiSkill id (PickCube-v1) or a fast torch task (FastReach-v0, FastPush-v0)
num_demos: int = 1000  # demonstrations to clone (generated once, then cached)
demo_file: str = ""  # an existing ManiSkill .h5 (state, pd_ee_delta_pos); "" means generate
rollout_episodes: int = 200  # stage-1 rollouts per noise level, added to the demos
rollout_noise_stds: list[float] = [0.0, 0.1]  # action-noise std of each rollout batch (actions lie in [-1, 1])
rollout_inference_steps: int = 4  # K of the stage-1 policy during the rollouts
rollout_checkpoint: str = ""  # a checkpoint whose policy collects the rollouts in place of stage 1's, e.g. a steering run's last.pt: RFC after steering (empty: stage 1)
critic: str = "iql"  # "iql" or "mc"
reward: str = "sparse"  # "sparse" (success) or "dense" (normalized_dense)
gamma: float = 0.99  # discount per env step
expectile: float = 0.7  # IQL's expectile tau for V (0.5 is the mean)
target_polyak: float = 0.005  # rate of the target critic's soft update
critic_hidden_dims: list[int] = [256, 256]  # hidden widths of the Q and V nets
critic_lr: float = 0.0003  # the critic's learning rate
critic_steps: int = 1000  # critic gradient steps
critic_batch_size: int = 512  # transitions per critic step
holdout_fraction: float = 0.25  # share of episodes held out to score the critic
beta: float = 10.0  # inverse temperature of the weights exp(beta A)
max_weight: float = 20.0  # weights clipped at this value
weighting: str = "exp"  # "exp" (clipped) or "softmax" (per batch of the whole dataset)
rfc_masks: list[str] = ["success_only", "advantage_positive", "advantage_topk"]  # one RFC run per mask and training seed ([]: none)
rfc_topk: float = 0.25  # advantage_topk: the share of windows kept
fql_offline_steps: int = 500  # FQL's offline updates on the same data, per training seed (0: no FQL row)
fql_alpha: float = 10.0  # FQL's distillation weight against the normalised -Q
fql_hidden_dims: list[int] = [256, 256, 256]  # FQL's one-step policy MLP
start_net: str = "ema"  # the stage-1 weights training goes on from: "ema" (the policy stage 1 scored) or "raw" (its live net)
flow_episodes: str = "uncut"  # the flow trains on episodes "uncut" (as recorded) or "cut" at the first success (as the critic)
train_seeds: list[int] = [0]  # one AW-ShortCut training run per seed
train_steps: int = 500  # gradient steps
batch_size: int = 512  # samples per gradient step
lr: float = 0.0001  # peak learning rate (AdamW, cosine decay)
weight_decay: float = 1e-06  # AdamW weight decay
warmup_steps: int = 50  # linear learning-rate warm-up steps
ckpt_every: int = 250  # write last.pt every this many steps (a run resumes from it)
keep_every: int = 0  # also keep step_<N>.pt every keep_every steps (0: none)
log_every: int = 25  # log the losses every this many steps
eval_every: int = 0  # evaluate every this many steps (0 means only at the end)
select_inference_steps: int = 4  # K whose success_once picks best_model.pt
eval_inference_steps: list[int] = [4]  # integration steps K at which the final report evaluates
num_eval_episodes: int = 500  # held-out episodes per evaluation
val_seed: int = 10000  # periodic evaluations (best_model.pt); as in notebook 01
eval_seed: int = 20000  # the stage-1 vs stage-2 comparison; held out from demos and rollouts
num_envs: int = 500  # parallel envs
max_episode_steps: int = 40  # env steps per episode
backend: str = "auto"  # auto, physx_cpu or physx_cuda (a fast task maps them to torch_cpu or torch_cuda)
num_threads: int = 1  # torch CPU threads (0 means torch's default)
resume: bool = True  # go on from the run folder's last.pt when there is one
run_name: str = "default"  # the run folder, outputs/<notebook>/<run_name>
wandb_mode: str = "disabled"  # disabled, offline (a local W&B run) or online

# %%
cfg = config.from_globals(awsc.AWShortCutConfig, globals())
run_path, tracker = start_run("02_aw_shortcut", cfg)
stage1_path = awsc.stage1_checkpoint_path(cfg)
stage1 = bc.load_policy(stage1_path)
print(f"run folder: {runs.shown(run_path)}; stage 1: {stage1_path.parent.name}/{stage1_path.name}")
rollout_path = awsc.rollout_checkpoint_path(cfg)  # None: stage 1 collects the rollouts
rollout_policy = stage1 if rollout_path is None else evaluate.load_checkpoint_policy(rollout_path)[0]
if rollout_path is not None:
    awsc.check_rollout_policy(rollout_policy.meta, stage1.meta, rollout_path)
    print(f"rollouts by {rollout_path.parent.name}/{rollout_path.name} (RFC after steering)")

# %% [markdown]
# ## Data with contrast: demos + stage-1 rollouts
# **After steering** (`rollout_checkpoint`). Stage 3's steering methods leave the flow's weights as they are: DSRL
# learns where the chain starts ($x_0$, `flowlib.methods.latent`), the per-step residual a correction of every action
# (`flowlib.methods.residual_step`). Set `rollout_checkpoint` to such a run's `last.pt` and its deterministic policy
# collects the rollouts instead of stage 1's; RFC's `success_only` mask below then reflows the flow on the demos and
# the steered episodes that succeed, distilling what the steering found into the flow itself, which acts from
# $x_0 \sim \mathcal N(0, I)$ with no head and no residual net (the RLinf notes pair RFC with DSRL this way). The
# steered policy is scored beside the others as the teacher. How far it goes depends on how many steered successes
# the mask keeps beside the demos: on StackCube-v1, 80 beside 298 demos left the flow at its start; on FastPush-v0,
# ~1,900 of DSRL's beside 1,000 demos carried about half of the teacher's gain into the flow (0.672 -> 0.83, the
# teacher 0.995; `params/02_aw_shortcut/fast_push_after_dsrl.yaml`, docs/results/stage2_aw_shortcut.md).

# %%
t0 = time.time()
demo_path = cfg.demo_file or generate_demos(cfg.env_id, cfg.num_demos)
demos = load_demos(demo_path, max_episodes=None if cfg.demo_file else cfg.num_demos)
awsc.check_data_fits(stage1.meta, demos, cfg.env_id)
env = make_env(cfg.env_id, cfg.num_envs, max_episode_steps=cfg.max_episode_steps, backend=cfg.backend)
bc.check_compatible(stage1.meta, env.spec)
rollouts, rollout_rows = awsc.collect_rollouts(rollout_policy, env, cfg, rollout_path or stage1_path)
by = "steered" if rollout_path else "rollout"
sources = ["demo"] * len(demos) + [f"{by} σ={r['noise_std']:g}" for r in rollout_rows for _ in range(r["episodes"])]
recorded = demos + rollouts
episodes = [critics.truncate_at_success(ep) for ep in recorded]  # the critic's: a success is terminal
check_held_out("eval_seed", cfg.eval_seed, cfg.num_eval_episodes + cfg.num_envs, episodes)
check_held_out("val_seed", cfg.val_seed, cfg.num_eval_episodes + cfg.num_envs, episodes)
print(f"data ready in {time.time() - t0:.0f}s")
data_table = pd.DataFrame({"source": sources, "success": [ep.success.any() for ep in episodes],
                           "length": [len(ep) for ep in episodes]}).groupby("source").agg(
    episodes=("success", "size"), success_rate=("success", "mean"), mean_length=("length", "mean"))
data_table.round(2)

# %%
# NBVAL_CHECK_OUTPUT
print(f"episodes: {len(demos)} demos + {len(rollouts)} rollouts over {len(cfg.rollout_noise_stds)} noise levels")
print(f"contrast (some episodes succeed, some fail): {0 < np.mean([ep.success.any() for ep in episodes]) < 1}")

# %% [markdown]
# ## SMDP transitions and the critic
# One transition per decision step of the cut episodes; episodes split by source into training and held-out
# sets. The held-out episodes measure whether $V$ tracks real returns.
#
# The flow trains on the episodes as recorded (`flow_episodes = "uncut"`): a demo goes on for a few steps after
# its first success, and cutting it there would pad the windows past the cut with "hold still", teaching the
# flow to stop at the very edge of success (on PushCube that alone cost ~0.1 success; docs/results/tasks.md).
# Each flow window takes the weight of the critic's window that decides at the same step, or, after the first
# success, at the success step (`critic.cut_window_index`).

# %%
dataset = ChunkDataset(episodes, stage1.obs_horizon, stage1.pred_horizon, stage1.obs_normalizer, stage1.action_normalizer,
                       gripper=not is_fast(cfg.env_id))
transitions = critics.chunk_transitions(dataset, stage1.act_horizon, cfg.gamma, cfg.reward)
held_out_episodes = awsc.holdout_mask(sources, cfg.holdout_fraction, cfg.seed)
held_out = torch.as_tensor(held_out_episodes)[transitions.episode]
train_data, test_data = transitions.subset(~held_out), transitions.subset(held_out)
flow_dataset = dataset if cfg.flow_episodes == "cut" else ChunkDataset(
    recorded, stage1.obs_horizon, stage1.pred_horizon, stage1.obs_normalizer, stage1.action_normalizer,
    gripper=not is_fast(cfg.env_id))
to_cut = critics.cut_window_index(flow_dataset, dataset)  # [N_flow]: the transition each flow window is weighted by
print(f"{len(transitions)} transitions: {len(train_data)} train, {len(test_data)} held out "
      f"({held_out_episodes.sum()} episodes); terminal: {int(transitions.terminal.sum())}; "
      f"flow windows ({cfg.flow_episodes}): {len(flow_dataset)}")

# %%
t0 = time.time()
fitted, curves = {}, {}
for kind in dict.fromkeys([cfg.critic, "mc"]):  # the chosen critic, and Monte Carlo for comparison
    torch.manual_seed(cfg.seed)
    fitted[kind] = critics.build_critic(kind, stage1.meta, stage1.obs_normalizer, stage1.action_normalizer,
                                        cfg.critic_hidden_dims, cfg.expectile, cfg.target_polyak)
    curves[kind] = pd.DataFrame(critics.train_critic(fitted[kind], train_data, cfg.critic_steps, cfg.critic_batch_size,
                                                     cfg.critic_lr, cfg.seed, tracker, log_prefix=f"critic_{kind}/"))
critic = fitted[cfg.critic]
print(f"critics trained in {time.time() - t0:.0f}s")
fig, axes = plt.subplots(1, len(curves), figsize=(4.5 * len(curves), 2.8), squeeze=False)
for ax, (kind, curve) in zip(axes[0], curves.items()):
    curve.set_index("step").plot(ax=ax, logy=True, title=f"{kind} critic", xlabel="step", ylabel="loss")
runs.save_figure(fig, run_path, "critic_curves")
plt.show()

# %% [markdown]
# ### $V$ against the observed discounted return, on held-out episodes

# %%
fig, axes = plt.subplots(1, len(fitted), figsize=(4 * len(fitted), 3.4), squeeze=False)
pearson = {}
returns = test_data.mc_return.numpy()
for ax, (kind, model) in zip(axes[0], fitted.items()):
    v = awsc.values(model, test_data.obs).numpy()
    pearson[kind] = float(np.corrcoef(v, returns)[0, 1])
    ax.scatter(returns, v, s=4, alpha=0.4)
    lim = [min(returns.min(), v.min()), max(returns.max(), v.max())]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set_xlabel("held-out discounted return $G$")
    ax.set_ylabel("$V(s)$")
    ax.set_title(f"{kind}: Pearson r = {pearson[kind]:.2f}")
runs.save_figure(fig, run_path, "value_vs_return")
plt.show()
tracker.log({f"critic_{k}/pearson_r_heldout": r for k, r in pearson.items()}, 0)

# %%
# NBVAL_CHECK_OUTPUT
print(f"held-out correlation is a number: {all(np.isfinite(r) for r in pearson.values())}")
print(f"{cfg.critic} critic's V correlates positively with held-out return: {pearson[cfg.critic] > 0}")

# %% [markdown]
# ## Advantage weights
# $w = \min(\exp(\beta A), w_\max)$. Kish's effective sample size $(\sum w)^2 / (n \sum w^2)$ says
# how much of the data still counts: near 1, the weights barely differ from BC; near 0, a few
# samples dominate and $\beta$ is too large.

# %%
adv = awsc.advantages(critic, transitions)
weights = critics.advantage_weights(adv, cfg.beta, cfg.max_weight, cfg.weighting)
ess = critics.effective_sample_size(weights)
episode_source = np.asarray(sources)[transitions.episode.numpy()]
episode_success = np.array([ep.success.any() for ep in episodes])[transitions.episode.numpy()]
by_source = pd.DataFrame({"source": episode_source, "episode succeeded": episode_success, "advantage": adv.numpy(),
                          "weight": weights.numpy()}).groupby(["source", "episode succeeded"]).mean()
fig, ax = plt.subplots(figsize=(5, 2.8))
ax.hist(weights.numpy(), bins=60, log=True)
ax.set_xlabel("weight w")
ax.set_ylabel("dataset windows")
ax.set_title(f"β = {cfg.beta:g}, ESS = {ess:.2f}, clipped at {cfg.max_weight:g}: {(weights >= cfg.max_weight).float().mean():.1%}")
runs.save_figure(fig, run_path, "weights")
plt.show()
tracker.log({"weights/ess": ess, "weights/max": weights.max().item()}, 0)
by_source.round(3)

# %%
# NBVAL_CHECK_OUTPUT
print(f"weights positive and clipped: {bool((weights > 0).all() and (weights <= cfg.max_weight + 1e-6).all())}")
print(f"effective sample size in (0, 1]: {0 < ess <= 1}")

# %% [markdown]
# ## AW-ShortCut training
# Starts from the stage-1 checkpoint (weights, EMA and normalisers) with a fresh optimiser; one run
# per training seed under `seed_<k>/`, each checkpoint holding the critic too (for stage 3).

# %%
t0 = time.time()
stage2, aw_rows = awsc.train_weighted(cfg, flow_dataset, run_path, env, stage1_path, weights[to_cut],
                                      {"critic": critics.critic_state(critic), "stage1_checkpoint": str(stage1_path)})
for s, rows in aw_rows.items():
    history = pd.DataFrame(rows)
    plt.plot(history["step"], history["loss"], label=f"seed {s}")
plt.yscale("log")
plt.xlabel("step")
plt.ylabel("weighted ShortCut loss")
plt.legend()
plt.title("AW-ShortCut: the advantage-weighted loss per training seed")
runs.save_figure(plt.gcf(), run_path, "aw_loss")
plt.show()
train_time = time.time() - t0
print(f"{len(cfg.train_seeds)} seed(s) x {cfg.train_steps} steps in {train_time:.0f}s")

# %% [markdown]
# ## The same data, other offline methods: RFC's masks and FQL
# **RFC's masks, offline.** The RLinf notes' reflow fine-tuning trains the flow again on its own chunks, keeping
# only those a mask picks. Here the chunks are this notebook's fixed data rather than fresh rollouts (stage 3's
# `learner = "rfc"` is the online form), so RFC becomes *filtered* behaviour cloning: the ShortCut loss of
# AW-ShortCut with a 0/1 weight in place of $\exp(\beta A)$, rescaled to mean 1, $w = m / \bar m$
# (`critic.rfc_mask`, `critic.mask_weights`). `success_only` keeps the windows of episodes that succeeded (every
# demo and the successful rollouts), `advantage_positive` the windows with $A > 0$ under the critic above,
# `advantage_topk` the top `rfc_topk` share by $A$. A mask ignores how large an advantage is; AW-ShortCut ignores
# nothing but shrinks every difference through $\beta$.
#
# **FQL offline** (Park, Li & Levine 2025, Eq. 6-7; `flowlib.methods.fql.fql_update`). The flow $\mu_\theta(s, z)$ (its ODE from
# the noise $z$) stays frozen; a one-step policy $\mu_\omega(s, z)$, an MLP, is distilled from it while being
# pushed up its own twin $Q$ of chunk decisions, fitted on the same episodes with the sparse reward:
# $$L_\pi(\omega) = \mathbb E_{s,\, z \sim \mathcal N(0, I)}\Big[-\frac{Q(s, \mu_\omega(s, z))}{\overline{|Q|}}
#   + \alpha\, \|\mu_\omega(s, z) - \mu_\theta(s, z)\|^2\Big].$$
# Unlike the weighted losses, it asks the critic about actions that are not in the data ($\mu_\omega$'s own), and
# $\alpha$ is all that keeps it near them. It is the offline half of stage 3's `learner = "fql"`.

# %%
window_success = torch.as_tensor(episode_success)
masks = {kind: critics.rfc_mask(kind, adv, window_success, torch.ones_like(adv), cfg.rfc_topk) for kind in cfg.rfc_masks}
# on the flow's windows: each takes its transition's weight or mask (to_cut), masks rescaled to mean 1 there
method_weights = {"AW-ShortCut": weights[to_cut]} | {f"RFC {kind}": critics.mask_weights(m[to_cut]) for kind, m in masks.items()}
# where each method puts the data's mass: the share of the loss's total weight on each source
uniform = torch.ones(len(flow_dataset))
mass = pd.DataFrame({name: pd.Series(w.numpy()).groupby(episode_source[to_cut.numpy()]).sum() / w.sum().item()
                     for name, w in {"BC (uniform)": uniform, **method_weights}.items()})
fig, ax = plt.subplots(figsize=(6, 2.8))
mass.T.plot.barh(stacked=True, ax=ax)
ax.set_xlabel("share of the loss's weight")
ax.set_ylabel("method")
ax.legend(loc="center left", bbox_to_anchor=(1, 0.5), fontsize=8)
ax.set_title("where each method's weight goes, by the data's source")
runs.save_figure(fig, run_path, "weight_by_source")
plt.show()
mask_ratio = {kind: m[to_cut].float().mean().item() for kind, m in masks.items()}  # share of the flow's windows kept
tracker.log({f"reflow_mask_ratio/{kind}": r for kind, r in mask_ratio.items()}, 0)
pd.DataFrame({"reflow_mask_ratio": mask_ratio}).round(3)

# %%
t0 = time.time()
rfc_policies = {}
for kind in cfg.rfc_masks:
    rfc_policies[kind], _ = awsc.train_weighted(cfg, flow_dataset, run_path / f"rfc_{kind}", env, stage1_path,
                                                method_weights[f"RFC {kind}"],
                                                {"rfc_mask": kind, "stage1_checkpoint": str(stage1_path)},
                                                checkpoint_format=bc.CHECKPOINT_FORMAT, name=f"rfc_{kind}")
print(f"RFC: {len(cfg.rfc_masks)} mask(s) x {len(cfg.train_seeds)} seed(s) in {time.time() - t0:.0f}s")

# %%
t0 = time.time()
fql_agents, fql_settings = {}, fql.FQLSettings(cfg.fql_alpha, actor_lr=cfg.lr, critic_lr=cfg.critic_lr,
                                               target_tau=cfg.target_polyak)
for s in cfg.train_seeds if cfg.fql_offline_steps else []:
    torch.manual_seed(s)
    agent = fql.FQLAgent(bc.load_policy(stage1_path), cfg.select_inference_steps, tuple(cfg.fql_hidden_dims),
                         tuple(cfg.critic_hidden_dims))
    path = run_path / "fql" / f"seed_{s}" / "last.pt"
    if cfg.resume and path.exists():
        saved = runs.load_torch(path, "FQL's offline agent")
        if saved["steps"] != cfg.fql_offline_steps:
            raise ValueError(f"{path} holds {saved['steps']} FQL offline steps, not fql_offline_steps="
                             f"{cfg.fql_offline_steps}: use another run_name or set resume=False to start over")
        agent.load_state_dict(saved["agent"])
    else:
        stats = fql.train_offline(agent, fql.demo_decisions(agent, episodes, cfg.gamma), cfg.fql_offline_steps,
                                  cfg.critic_batch_size, fql_settings, s)
        runs.save_torch({"agent": agent.state_dict(), "settings": dataclasses.asdict(fql_settings),
                         "steps": cfg.fql_offline_steps, "stats": stats, "stage1_checkpoint": str(stage1_path)}, path)
    fql_agents[s] = agent.eval()
print(f"FQL offline: {len(fql_agents)} seed(s) x {cfg.fql_offline_steps} steps in {time.time() - t0:.0f}s")

# %% [markdown]
# ## Stage 2 against stage 1, on the same evaluation seeds
# Env seeds `eval_seed`, `eval_seed + 1`, ...: held out from every training episode (demos start at
# seed 0, stage-1 rollouts at 1 000 000; the check after loading the data refuses an overlap).

# %%
methods = {"AW-ShortCut": stage2} | {f"RFC {kind}": p for kind, p in rfc_policies.items()}
methods |= {"FQL offline": fql_agents} if fql_agents else {}
rows, one_step = [], {}  # FQL's one-step policy ignores K: scored once, listed at every K
for K in cfg.eval_inference_steps:
    r1 = bc.evaluate(stage1, env, cfg.num_eval_episodes, K, seed=cfg.eval_seed)
    rows.append({"method": "stage 1", "seed": -1, "K": K, "success_once": r1["success_once"], "success_at_end": r1["success_at_end"]})
    if rollout_path is not None:  # the steered policy that collected the rollouts: the teacher
        rt = bc.evaluate(rollout_policy, env, cfg.num_eval_episodes, K, seed=cfg.eval_seed)
        rows.append({"method": "steered (rollouts)", "seed": -1, "K": K, "success_once": rt["success_once"],
                     "success_at_end": rt["success_at_end"]})
    for name, by_seed in methods.items():
        for s, policy in by_seed.items():
            k_free = isinstance(policy, fql.FQLAgent)
            r2 = one_step[s] if k_free and s in one_step else bc.evaluate(policy, env, cfg.num_eval_episodes, K,
                                                                           seed=cfg.eval_seed)
            if k_free:
                one_step[s] = r2
            rows.append({"method": name, "seed": s, "K": K, "success_once": r2["success_once"], "success_at_end": r2["success_at_end"]})
evals = pd.DataFrame(rows)
evals.to_csv(run_path / "stage1_vs_stage2.csv", index=False)
order = list(dict.fromkeys(evals.method))
table = evals.groupby(["K", "method"], sort=False)[["success_once", "success_at_end"]].agg(["mean", "std", "count"])
fig, ax = plt.subplots(figsize=(6.5, 2.8))
means = evals.groupby(["K", "method"])["success_once"].mean().unstack()[order]
spread = evals.groupby(["K", "method"])["success_once"].std().unstack()[order].fillna(0)
means.plot.bar(ax=ax, yerr=spread, rot=0, capsize=3)
ax.set_ylim(0, 1)
ax.set_ylabel("success_once")
ax.set_xlabel("K")
ax.legend(loc="center left", bbox_to_anchor=(1, 0.5), fontsize=8)
ax.set_title(f"{cfg.env_id}, {cfg.num_eval_episodes} episodes, {len(cfg.train_seeds)} training seed(s)")
runs.save_figure(fig, run_path, "stage1_vs_stage2")
plt.show()
table.round(3)

# %%
# NBVAL_CHECK_OUTPUT
print(f"every method evaluated for every training seed: "
      f"{all(sorted(evals[evals.method == m].seed.unique().tolist()) == sorted(cfg.train_seeds) for m in methods)}")
print(f"success rates within [0, 1]: {bool(evals[['success_once', 'success_at_end']].stack().between(0, 1).all())}")

# %%
env.close()
K = cfg.select_inference_steps if cfg.select_inference_steps in cfg.eval_inference_steps else cfg.eval_inference_steps[0]
at_k = evals[evals.K == K]
s1 = at_k[at_k.method == "stage 1"].success_once.mean()
by_method = at_k[at_k.method != "stage 1"].groupby("method", sort=False).success_once
s2 = by_method.get_group("AW-ShortCut")
verdict = "better than" if s2.mean() > s1 else ("equal to" if s2.mean() == s1 else "worse than")
summary = {"stage1_checkpoint": str(stage1_path), "rollout_checkpoint": str(rollout_path or ""), "rollouts": rollout_rows, "pearson_r_heldout": pearson, "ess": ess,
           "K": K, "stage1_success_once": s1, "stage2_success_once_mean": s2.mean(),
           "stage2_success_once_std": s2.std() if len(s2) > 1 else 0.0, "train_time_s": train_time,
           "reflow_mask_ratio": mask_ratio,
           "methods": {m: {"success_once_mean": g.mean(), "success_once_std": g.std() if len(g) > 1 else 0.0,
                           "seeds": len(g)} for m, g in by_method}}
tracker.summary(summary)
tracker.finish()
print(f"stage 2 at K={K}: {s2.mean():.2f} ± {summary['stage2_success_once_std']:.2f} over {len(s2)} seed(s), "
      f"{verdict} stage 1 ({s1:.2f})")
for m, g in by_method:
    print(f"  {m:>24}: {g.mean():.2f} (minus stage 1: {g.mean() - s1:+.2f})")
