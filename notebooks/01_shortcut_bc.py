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
# # 01 · Stage 1: ShortCut Flow behaviour cloning of action chunks
#
# The first stage of the pipeline: clone demonstrations with a **step-size-conditioned flow over action chunks**,
# evaluated in the simulator with 1, 2, 4 and 8 integration steps, then set against its DDPM twin (Diffusion Policy's
# objective on the same demos, net and steps) at 100, 10, 4 and 1 steps.
#
# **By default** the task is `FastReach-v0` (a torch task: 1,000 demos of a scripted, deliberately imperfect
# demonstrator; an MLP velocity net, as ReinFlow's state tasks use), so the clone succeeds in about half its held-out
# episodes in under a minute, and notebooks 02 and 06 start from it. ManiSkill3's motion-planned PickCube demos with
# the U-Net: `params/01_shortcut_bc/cpu.yaml` and `cpu150*.yaml` ([stage 1's record](../docs/results/stage1_shortcut_bc.md));
# Meta-World's scripted experts: `metaworld_*.yaml` ([record](../docs/results/metaworld.md)).
#
# **Action chunking** (Zhao et al. 2023; Chi et al. 2023). The policy sees a window of the last
# $T_o = 2$ observations and predicts a chunk of $H = 16$ future actions, of which it executes the
# $T_a = 8$ starting at the current step, then re-plans. Chunks make the policy temporally
# consistent and divide the number of network calls by $T_a$.
#
# **The ShortCut objective, conditioned on the observation** (Frans et al. 2024, Eq. 5; notebook 00):
# with $a_0 \sim \mathcal N(0, I)$ and $a_1$ the normalised demo chunk, $a_t = (1 - t)a_0 + t a_1$,
# $$\mathcal L = \mathbb E\,\big\|s_\theta(a_t, t, d_\min \mid o) - (a_1 - a_0)\big\|^2
#   + \mathbb E\,\big\|s_\theta(a_t, t, 2d \mid o) - \tfrac12\big[s(a_t, t, d \mid o) + s(a'_{t+d}, t + d, d \mid o)\big]_\text{EMA}\big\|^2 ,$$
# the second term on a quarter of each batch. The same `flowlib.flows.models.ShortCut.loss` as in notebook 00
# (no second copy); only the network changes: `ShortCutVelocityUNet1D`, Diffusion Policy's 1D
# temporal U-Net with FiLM conditioning on $(t, d, o)$ (`velocity_net: unet`), or `ChunkVelocityMLP`, one MLP over
# the flat chunk, window, $t$ and $d$ (`velocity_net: mlp`, the default here).
#
# **Evaluation** follows ManiSkill's imitation baselines: `max_episode_steps` per episode (100 on PickCube, 40 on
# FastReach), termination ignored, `success_once` (success at any step, the metric of record) and
# `success_at_end`. The policy is the deterministic ODE from seeded noise, EMA weights.
# The demos start from env seeds $0, 1, \dots$; evaluation uses held-out seeds (`val_seed` for the
# periodic checks that pick `best_model.pt`, `eval_seed` for the final report), because a policy
# replays the initial states it was trained on far better than new ones.

# %%
import dataclasses
import json
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from flowlib.flows import diffusion
from flowlib.policies import bc, policy_eval
from flowlib.infra import config, runs
from flowlib.envs import visual
from flowlib.envs.data import check_held_out
from flowlib.envs.maniskill import make_env
from flowlib.infra.tracking import Tracker, start_run

# %% tags=["parameters"]
# Defaults: the small CPU run (under a minute on 2 cores): an MLP flow cloned from FastReach-v0's imperfect
# demonstrator, and its DDPM twin. ManiSkill runs: params/01_shortcut_bc/cpu.yaml (2 CPU cores), gpu.yaml; from the
# camera: pickcube_rgb_cpu.yaml, pickcube_pointcloud_cpu.yaml; Meta-World: metaworld_*.yaml.
seed: int = 0  # seed of torch and of the run's random draws
env_id: str = "FastReach-v0"  # the task: a ManiSkill id (PickCube-v1) or a fast torch task (FastReach-v0, FastPush-v0)
num_demos: int = 1000  # demonstrations to clone (generated once, then cached)
demo_file: str = ""  # an existing ManiSkill .h5 (state, pd_ee_delta_pos); "" means generate
obs_horizon: int = 2  # observations the policy conditions on (T_o)
pred_horizon: int = 16  # actions per predicted chunk (H)
act_horizon: int = 8  # actions of each chunk executed before replanning (T_a)
action_norm: str = "minmax"  # "minmax" (to [-1, 1], Diffusion Policy's) or "meanstd" (standardised)
velocity_net: str = "mlp"  # "unet" (1D temporal U-Net over the chunk) or "mlp" (one flat MLP, ReinFlow's)
down_dims: list[int] = [32, 64]  # the U-Net's channel widths
mlp_dims: list[int] = [256, 256, 256]  # the MLP's layer widths
emb_dim: int = 32  # width of the time and step-size embeddings
obs_emb_dim: int = 0  # 0: the flat obs window conditions the U-Net; > 0: an MLP obs_encoder first
obs_mode: str = "state"  # "state", or from the task camera "rgb", "rgbd", "pointcloud" (flowlib.envs.visual)
camera_size: int = 64  # the camera's width and height in pixels (visual obs modes)
num_points: int = 512  # points per point-cloud frame (obs_mode pointcloud)
random_shift: int = 4  # DrQ's image augmentation: pad and re-crop by up to this many pixels (0: off)
demos_in_memory: bool = True  # visual demos: read every frame once; false: stream each batch's from disk
model: str = "shortcut"  # "shortcut"; "reflow" or "meanflow" (plain flows); "ddpm" (the diffusion baseline)
diffusion_steps: int = 100  # model ddpm: its training timesteps T (sampling takes 1 to T steps)
diffusion_sampler: str = "ddim"  # model ddpm: the sampler the periodic evaluations (best_model.pt) use
compare_diffusion: bool = True  # a flow model: also train its DDPM twin (same demos, net, steps) and compare
diffusion_eval_steps: list[int] = [100, 10, 4, 1]  # the twin's step counts
shortcut_max_steps: int = 8  # the finest ShortCut step d_min is 1 / shortcut_max_steps
bootstrap_fraction: float = 0.25  # share of each batch given the ShortCut self-consistency target
ema_decay: float = 0.995  # the sampled net is the Polyak average of the trained one at this decay; 0: no EMA [toolkit: stage 1's EMA]
train_steps: int = 2000  # gradient steps
batch_size: int = 256  # samples per gradient step
lr: float = 0.001  # peak learning rate (AdamW, cosine decay)
lr_schedule: str = "cosine"  # after the warm-up: "cosine" (decay to zero) or "constant"
weight_decay: float = 1e-06  # AdamW weight decay
warmup_steps: int = 200  # linear learning-rate warm-up steps
ckpt_every: int = 500  # write last.pt every this many steps (a run resumes from it)
keep_every: int = 0  # also keep step_<N>.pt every keep_every steps (0: none), e.g. to pick a start
log_every: int = 25  # log the losses every this many steps
eval_every: int = 1000  # 0: evaluate only at the end
select_inference_steps: int = 4  # K whose success_once picks best_model.pt
eval_inference_steps: list[int] = [1, 2, 4, 8]  # integration steps K at which the final report evaluates
num_eval_episodes: int = 200  # held-out episodes per evaluation
val_seed: int = 10000  # env seeds of the periodic evaluations that pick best_model.pt
eval_seed: int = 20000  # env seeds of the final report (demos use seeds from 0: keep these apart)
num_envs: int = 200  # parallel envs
max_episode_steps: int = 40  # env steps per episode
backend: str = "auto"  # auto, physx_cpu or physx_cuda (a fast task maps them to torch_cpu or torch_cuda)
num_threads: int = 1  # torch CPU threads (0: torch's default); 1 leaves the other cores to the envs
resume: bool = True  # go on from the run folder's last.pt when there is one
run_name: str = "default"  # the run folder, outputs/<notebook>/<run_name>
wandb_mode: str = "disabled"  # disabled, offline (a local W&B run) or online

# %%
cfg = config.from_globals(bc.ShortCutBCConfig, globals())
run_path, tracker = start_run("01_shortcut_bc", cfg)
print(f"run folder: {runs.shown(run_path)}")

# %% [markdown]
# ## Demonstrations
# On ManiSkill, its motion planner solves the task (`mplib`); ManiSkill's replay tool converts each
# solution to state observations and `pd_ee_delta_pos` actions (end-effector displacement + gripper),
# recording dense rewards and success flags, which later stages need. A fast task's scripted demonstrator and
# Meta-World's experts write the same format. Cached under `outputs/data/`.
# With `obs_mode` `rgb`, `rgbd` or `pointcloud`, each demo frame is also rendered from the task camera by setting the
# simulator to the demo's recorded state (`flowlib.envs.visual.replay_visual`), so frames, states and actions line up.

# %%
t0 = time.time()
dataset, episodes = bc.demo_dataset(cfg)  # a visual obs_mode renders the demos into it once (flowlib.envs.visual)
lengths = np.array([len(ep) for ep in episodes])
print(f"demos ready in {time.time() - t0:.0f}s: {len(episodes)} episodes, length {lengths.mean():.1f} ± {lengths.std():.1f}")
check_held_out("val_seed", cfg.val_seed, cfg.num_eval_episodes + cfg.num_envs, episodes)
check_held_out("eval_seed", cfg.eval_seed, cfg.num_eval_episodes + cfg.num_envs, episodes)

# %%
# NBVAL_CHECK_OUTPUT
print(f"episodes: {len(episodes)}; obs dim {episodes[0].obs.shape[1]}; action dim {episodes[0].actions.shape[1]}")
print(f"every demo succeeds: {all(ep.success.any() for ep in episodes)}; rewards recorded: {all(len(ep.rewards) == len(ep) for ep in episodes)}")

# %% [markdown]
# ## Windows: observation history and action chunk
# Sample $i$ pairs $o_{s:s+T_o}$ with $a_{s:s+H}$; windows overhanging the episode are padded
# (first observation / action before the start; after the end a zero displacement with the last
# gripper command, i.e. "hold still"; every dim zero on a task without a gripper). Observations are
# standardised, actions min-max scaled to $[-1, 1]$ (or standardised, `action_norm: meanstd`); both
# normalisers are stored with the checkpoint.

# %%
obs_w, act_w = dataset.batch([len(dataset) // 3]) if cfg.obs_mode != "state" else dataset[len(dataset) // 3]
obs_w, act_w = obs_w.reshape(cfg.obs_horizon, -1), act_w.reshape(cfg.pred_horizon, -1)  # [To, O], [H, A]
fig, ax = plt.subplots(figsize=(6, 2.6))
ax.plot(act_w.numpy(), marker=".")
ax.axvspan(cfg.obs_horizon - 1, cfg.obs_horizon - 1 + cfg.act_horizon, color="0.9", label="executed")
ax.set_xlabel("chunk index")
ax.set_ylabel("normalised action")
ax.legend(["dx", "dy", "dz", "gripper", "executed"], fontsize=7, ncol=5)
ax.set_title("one demo chunk: observed, then executed (shaded) actions")
runs.save_figure(fig, run_path, "action_chunk")
plt.show()

# %%
# NBVAL_CHECK_OUTPUT
print(f"windows: {len(dataset) == sum(len(ep) for ep in episodes)} (one per step the policy acts at)")
print(f"obs window {tuple(obs_w.shape)}, action chunk {tuple(act_w.shape)}")

# %% [markdown]
# ## What the camera sees
# A visual policy reads, per frame, the robot's own state and the task's goal (no object pose) packed with the camera's
# view: colour (`rgb`), colour and depth (`rgbd`) or the points above the table (`pointcloud`, farthest-point sampled).
# Its `obs_encoder` turns each frame's view into features (`flowlib.policies.encoders`: a CNN with a spatial soft-argmax, or
# DP3's PointNet); the rest of the policy is the state policy's. A state policy (the default) has no camera.

# %%
if cfg.obs_mode == "state":
    print(f"obs_mode state: the policy reads the {dataset.obs_dim}-dim state vector (no camera)")
else:
    steps = np.linspace(0, len(episodes[0]), 5).astype(int)
    state_dim = dataset.layout.state_dim
    fig = plt.figure(figsize=(2.2 * len(steps), 2.3))
    for i, s in enumerate(steps):
        frame = torch.as_tensor(dataset.window(0, int(s))[0][-1])
        view = dataset.layout.split(frame)[1].numpy()
        if cfg.obs_mode == "pointcloud":
            ax = fig.add_subplot(1, len(steps), i + 1, projection="3d")
            ax.scatter(view[:, 0], view[:, 1], view[:, 2], s=2, c=view[:, 2], cmap="viridis")
            ax.set_xticks([]), ax.set_yticks([]), ax.set_zticks([])
        else:
            ax = fig.add_subplot(1, len(steps), i + 1)
            ax.imshow(view[..., :3].astype(np.uint8))
            ax.set_axis_off()
        ax.set_title(f"demo 0, step {s}", fontsize=8)
    runs.save_figure(fig, run_path, "camera")
    plt.show()
    print(f"obs_mode {cfg.obs_mode}: each frame packs {state_dim} state dims with a view of shape "
          f"{dataset.layout.view_shape}")

# %% [markdown]
# ## Simulator
# `flowlib.envs.maniskill.make_env` picks `physx_cuda` with many envs on a GPU, else `physx_cpu` with one
# env per process behind gymnasium's `AsyncVectorEnv`; a fast task steps all its envs as one torch batch, and
# Meta-World runs one MuJoCo env per process. Same batched-torch interface either way.

# %%
env = make_env(cfg.env_id, cfg.num_envs, max_episode_steps=cfg.max_episode_steps, backend=cfg.backend,
               **visual.policy_env_kwargs(bc.observation_meta(cfg, dataset)))
print(f"backend {env.backend}, {env.num_envs} envs")

# %%
# NBVAL_CHECK_OUTPUT
print(env.spec)

# %% [markdown]
# ## Training
# AdamW with warm-up and cosine decay, EMA weights (also the ShortCut teacher), gradient clipping.
# `last.pt` is written every `ckpt_every` steps (atomically); re-running the notebook with the
# same `run_name` resumes from it.

# %%
t0 = time.time()
policy, best = bc.train(cfg, dataset, run_path, tracker, env=env)
train_time = time.time() - t0
history = pd.DataFrame(tracker.rows)
fig, ax = plt.subplots(figsize=(6, 2.8))
ax.plot(history["step"], history["loss"], label="loss")
for part, label in (("flow_mse", "flow-matching part"), ("consistency_mse", "self-consistency part")):
    if part in history:  # ShortCut's parts; no self-consistency part with bootstrap_fraction 0, none for model reflow
        ax.plot(history["step"], history[part], label=label)
ax.set_yscale("log")
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.legend()
ax.set_title(f"stage 1's loss ({cfg.model}) and its parts")
runs.save_figure(fig, run_path, "loss")
plt.show()
print(f"trained {cfg.train_steps} steps in {train_time:.0f}s")

# %%
# NBVAL_CHECK_OUTPUT
first, last = history["loss"].iloc[: max(1, len(history) // 5)].mean(), history["loss"].iloc[-max(1, len(history) // 5):].mean()
print(f"loss went down: {last < first}")
print(f"checkpoints: {sorted(p.name for p in run_path.glob('*.pt'))}")

# %% [markdown]
# ## Success against the number of integration steps
# The last EMA policy, on the same held-out evaluation seeds for every $K$; episodes run the full `max_episode_steps`.

# %%
rows = []
for K in cfg.eval_inference_steps:
    result = bc.evaluate(policy, env, cfg.num_eval_episodes, K, seed=cfg.eval_seed)
    rows.append({"inference steps": K, "success_once": result["success_once"], "success_at_end": result["success_at_end"],
                 "return": result["return"], "env steps/s": result["env_steps_per_s"]})
    tracker.log({f"eval_K{K}/success_once": result["success_once"], f"eval_K{K}/success_at_end": result["success_at_end"]},
                cfg.train_steps)
results = pd.DataFrame(rows).set_index("inference steps")
results.to_csv(run_path / "success_vs_steps.csv")
fig, ax = plt.subplots(figsize=(5, 2.8))
results[["success_once", "success_at_end"]].plot.bar(ax=ax, rot=0)
ax.set_ylim(0, 1)
ax.set_ylabel("success rate")
ax.set_title(f"{cfg.env_id}, {cfg.num_eval_episodes} held-out episodes")
runs.save_figure(fig, run_path, "success_vs_steps")
plt.show()
results.round(3)

# %%
# NBVAL_CHECK_OUTPUT
print(f"success rates are fractions of {cfg.num_eval_episodes} episodes: "
      f"{all(0 <= v <= 1 for v in results[['success_once', 'success_at_end']].to_numpy().ravel())}")
print(f"success_at_end <= success_once: {bool((results['success_at_end'] <= results['success_once']).all())}")
print(f"the clone succeeds in some held-out episodes: {bool(results['success_once'].max() > 0)}")

# %% [markdown]
# ## Flow against diffusion, at each step count
# The field's standard for action chunks is Diffusion Policy (Chi et al. 2023): a DDPM that learns the noise added to a
# demo chunk. With $\bar\alpha_k$ the squared-cosine schedule over $T = 100$ timesteps and $\epsilon \sim \mathcal N(0, I)$,
# $$a_k = \sqrt{\bar\alpha_k}\, a + \sqrt{1 - \bar\alpha_k}\, \epsilon, \qquad
#   \mathcal L = \mathbb E_{k, \epsilon}\,\big\|\epsilon - \epsilon_\theta(a_k, k \mid o)\big\|^2$$
# (Ho et al. 2020, Eqs. 4 and 14; `flowlib.flows.diffusion.DDPM.loss`), sampled by DDPM's ancestral chain (stochastic) or by DDIM (Song et al. 2021,
# Eq. 12, deterministic) with `diffusers`' schedulers. Its twin here (`flowlib.flows.diffusion.DDPM`, made by
# `bc.diffusion_twin`) has this run's demos, net, optimiser, EMA and gradient steps; only the objective and the
# sampler differ. Both are scored on the same held-out episodes; "ms per chunk" is one `act` on one window here.

# %%
if cfg.compare_diffusion and cfg.model != "ddpm":
    twin = bc.diffusion_twin(cfg)
    twin_tracker = Tracker(run_path / "ddpm", dataclasses.asdict(twin), wandb_mode=cfg.wandb_mode,
                           project="flowlib-01", name=f"{cfg.run_name}-ddpm", resume=cfg.resume)
    t0 = time.time()
    twin_policy, _ = bc.train(twin, dataset, run_path / "ddpm", twin_tracker, env=env)
    twin_time = time.time() - t0
    rows = [{"model": cfg.model, "sampler": "ode", "steps": K, "success_once": results.loc[K, "success_once"],
             "success_at_end": results.loc[K, "success_at_end"], "ms per chunk": policy_eval.chunk_ms(policy, K),
             "train s": train_time} for K in cfg.eval_inference_steps]
    for sampler in diffusion.SAMPLERS:
        twin_policy.flow.sampler = sampler
        for K in twin.eval_inference_steps:
            r = bc.evaluate(twin_policy, env, cfg.num_eval_episodes, K, seed=cfg.eval_seed)
            rows.append({"model": "ddpm", "sampler": sampler, "steps": K, "success_once": r["success_once"],
                         "success_at_end": r["success_at_end"], "ms per chunk": policy_eval.chunk_ms(twin_policy, K),
                         "train s": twin_time})
    twin_tracker.summary({"train_time_s": twin_time, "results": rows})
    twin_tracker.finish()
    comparison = pd.DataFrame(rows)
    comparison.to_csv(run_path / "flow_vs_diffusion.csv", index=False)
    fig, ax = plt.subplots(figsize=(5.5, 2.8))
    for (model, sampler), part in comparison.groupby(["model", "sampler"], sort=False):
        ax.plot(part["steps"], part["success_once"], marker="o", label=f"{model} ({sampler})")
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("denoising / integration steps per chunk")
    ax.set_ylabel("success_once")
    ax.legend(fontsize=8)
    ax.set_title(f"{cfg.env_id}: {cfg.model} against its DDPM twin, {cfg.num_eval_episodes} held-out episodes")
    runs.save_figure(fig, run_path, "flow_vs_diffusion")
    plt.show()
else:
    comparison = None
    print("no diffusion twin: compare_diffusion is off, or this run is the DDPM (model: ddpm) itself")
comparison.round(3) if comparison is not None else None

# %%
# NBVAL_CHECK_OUTPUT
if comparison is not None:
    print("rows:", {f"{m} ({s})": list(part["steps"]) for (m, s), part in comparison.groupby(["model", "sampler"], sort=False)})
    twin_rows = pd.DataFrame(twin_tracker.rows)
    print(f"the twin trained as many steps: {int(twin_rows['step'].max()) == cfg.train_steps}")
    print(f"its noise-prediction loss went down: {twin_rows['loss'].iloc[-3:].mean() < twin_rows['loss'].iloc[:3].mean()}")

# %% [markdown]
# ## What the encoder attends to
# The image encoder ends in a spatial soft-argmax (Levine et al. 2016): each of its channels becomes the expected
# image position of a softmax over pixels, a keypoint. Drawn over a demo frame: where the trained policy looks.

# %%
if cfg.obs_mode in ("rgb", "rgbd"):
    encoder = policy.flow.net.obs_encoder.cpu()
    window = dataset.batch([len(dataset) // 3], policy.obs_normalizer.cpu(), policy.action_normalizer.cpu())[0]
    maps = encoder.attention(window.flatten(1))[-1]  # [keypoints, H', W'] of the window's last frame
    image = dataset.layout.split(torch.as_tensor(dataset.window(*dataset.index[len(dataset) // 3])[0][-1]))[1]
    fig, axes = plt.subplots(1, 2, figsize=(5, 2.6))
    axes[0].imshow(image[..., :3].numpy().astype(np.uint8))
    axes[1].imshow(image[..., :3].numpy().astype(np.uint8))
    axes[1].imshow(maps.sum(0).numpy(), extent=(0, image.shape[1], image.shape[0], 0), alpha=0.6, cmap="magma")
    for ax, title in zip(axes, ("frame", "keypoint softmax maps, summed")):
        ax.set_axis_off()
        ax.set_title(title, fontsize=8)
    runs.save_figure(fig, run_path, "attention")
    plt.show()
else:
    print(f"obs_mode {cfg.obs_mode}: no image encoder to look into")

# %% [markdown]
# ## A rollout, rendered
# ManiSkill renders RGB on CPU (Mesa lavapipe); a fast task draws its state (FastReach: the hand in red, the goal in
# green). Frames of one episode at 4 inference steps.

# %%
with make_env(cfg.env_id, 1, max_episode_steps=cfg.max_episode_steps, backend=cfg.backend, render=True,
              **visual.policy_env_kwargs(policy.meta)) as render_env:
    shown = bc.evaluate(policy, render_env, 1, cfg.select_inference_steps, seed=cfg.eval_seed, frame_every=12)
frames = shown["frames"]
fig, axes = plt.subplots(1, len(frames), figsize=(1.9 * len(frames), 2.1), squeeze=False)
for i, (ax, frame) in enumerate(zip(axes[0], frames)):
    ax.imshow(frame)
    ax.set_axis_off()
    ax.set_title(f"step {12 * (i + 1)}", fontsize=8)
fig.suptitle(f"success_once = {shown['success_once']:.0f}")
runs.save_figure(fig, run_path, "rollout")
plt.show()

# %% [markdown]
# ## Benchmark: raw simulator vs policy in the loop
# The same envs stepped with random actions, against the evaluation above (policy at $K$ steps
# every $T_a$ env steps). The gap is the policy's overhead on this machine.

# %%
obs = env.reset(seed=cfg.eval_seed)
n_steps = 200
t0 = time.time()
for _ in range(n_steps):
    env.step(torch.rand(env.num_envs, env.spec.action_dim) * 2 - 1)
raw = n_steps * env.num_envs / (time.time() - t0)
bench = {"env_id": cfg.env_id, "backend": env.backend, "num_envs": env.num_envs, "raw_env_steps_per_s": raw,
         **{f"policy_K{K}_env_steps_per_s": results.loc[K, "env steps/s"] for K in cfg.eval_inference_steps},
         "torch_threads": torch.get_num_threads()}
runs.save_json(run_path / "benchmark.json", bench)
pd.Series(bench)

# %%
env.close()
summary = {"train_time_s": train_time, "best": best, "results": results.reset_index().to_dict("records"), "benchmark": bench}
tracker.summary(summary)
tracker.finish()
print(json.dumps({K: results.loc[K, "success_once"] for K in cfg.eval_inference_steps}))
