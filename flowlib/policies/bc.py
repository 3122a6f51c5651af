"""Stage 1: ShortCut Flow behaviour cloning of action chunks: its config, its demonstrations and windows, and the
training loop (``train``), which writes ``last.pt`` / ``best_model.pt`` atomically and resumes from ``last.pt``.

The policy it trains, ``FlowPolicy``, and the checkpoint format every stage reads are ``flowlib.policies.chunk_policy``'s
(still importable from here: ``bc.load_policy``, ``bc.FlowPolicy``, ...).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from flowlib.envs.data import ChunkDataset, Episode, Normalizer, generate_demos, load_demos
from flowlib.envs.maniskill import control_mode as task_control_mode
from flowlib.envs.maniskill import is_fast
from flowlib.envs.visual import augment_window, check_obs_mode
from flowlib.envs.visual_demos import VisualChunkDataset, replay_visual
from flowlib.flows.diffusion import SAMPLERS
from flowlib.infra import progress
from flowlib.infra.config import Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_fields
from flowlib.infra.guards import require_finite
from flowlib.infra.runs import set_rng_state
from flowlib.infra.schedules import LR_SCHEDULES, warmup_then
from flowlib.policies.chunk_policy import (  # noqa: F401  (bc.<name> keeps working: the protocol and checkpoints moved)
    AW_CHECKPOINT_FORMAT,
    CHECKPOINT_FORMAT,
    META_DEFAULTS,
    META_DEFAULTS_MODEL,
    META_DEFAULTS_OBS,
    MODELS,
    POLICY_FORMATS,
    VELOCITY_NETS,
    ChunkPolicy,
    FlowPolicy,
    build_policy,
    check_act_horizon,
    check_compatible,
    checkpoint_meta,
    complete_meta,
    features_dim,
    load_policy,
    observation_meta,
    read_checkpoint,
    save_checkpoint,
)
from flowlib.policies.policy_eval import evaluate  # noqa: F401  (bc.evaluate: what every stage scores a policy with)


@dataclass
class ShortCutBCConfig:
    """Parameters of notebook 01 (ShortCut BC). Defaults are the small CPU run: an MLP flow cloned from FastReach's
    imperfect demonstrator and its DDPM twin, scored on 200 held-out episodes (under a minute on 2 cores); the
    ManiSkill and Meta-World runs are ``params/01_shortcut_bc/*.yaml``."""

    seed: NonNegativeInt = 0
    env_id: str = "FastReach-v0"
    num_demos: PositiveInt = 1000
    demo_file: str = ""                 # an existing ManiSkill .h5 (state, pd_ee_delta_pos); "" means generate
    obs_horizon: PositiveInt = 2
    pred_horizon: PositiveInt = 16
    act_horizon: PositiveInt = 8
    action_norm: str = "minmax"         # "minmax" (to [-1, 1], Diffusion Policy's) or "meanstd" (standardised)
    velocity_net: str = "mlp"           # "unet" (1D temporal U-Net over the chunk) or "mlp" (one flat MLP, ReinFlow's)
    down_dims: list[PositiveInt] = field(default_factory=lambda: [32, 64])  # the U-Net's channel widths
    mlp_dims: list[PositiveInt] = field(default_factory=lambda: [256, 256, 256])  # the MLP's layer widths
    emb_dim: PositiveInt = 32  # width of the time and step-size embeddings
    obs_emb_dim: NonNegativeInt = 0     # 0: the flat obs window conditions the U-Net; > 0: an MLP obs_encoder first
    obs_mode: str = "state"             # "state", or from the task camera "rgb", "rgbd", "pointcloud" (flowlib.envs.visual)
    camera_size: PositiveInt = 64       # the camera's width and height in pixels (visual obs modes)
    num_points: PositiveInt = 512       # points per point-cloud frame (obs_mode pointcloud)
    random_shift: NonNegativeInt = 4    # DrQ's image augmentation: pad and re-crop by up to this many pixels (0: off)
    demos_in_memory: bool = True        # visual demos: read every frame once; false: stream each batch's from disk
    model: str = "shortcut"             # "shortcut"; "reflow" or "meanflow" (plain flows); "ddpm" (the diffusion baseline)
    diffusion_steps: PositiveInt = 100  # model ddpm: its training timesteps T (sampling takes 1 to T steps)
    diffusion_sampler: str = "ddim"     # model ddpm: the sampler the periodic evaluations (best_model.pt) use
    compare_diffusion: bool = True      # a flow model: also train its DDPM twin (same demos, net, steps) and compare
    diffusion_eval_steps: list[PositiveInt] = field(default_factory=lambda: [100, 10, 4, 1])  # the twin's step counts
    shortcut_max_steps: PositiveInt = 8  # the finest ShortCut step d_min is 1 / shortcut_max_steps
    bootstrap_fraction: Fraction = 0.25  # share of each batch given the ShortCut self-consistency target
    ema_decay: Fraction = 0.995  # the sampled net is the Polyak average of the trained one at this decay; 0: no EMA
                                 # [toolkit: stage 1's EMA]
    train_steps: PositiveInt = 2000
    batch_size: PositiveInt = 256
    lr: PositiveFloat = 1e-3
    lr_schedule: str = "cosine"         # after the warm-up: "cosine" (decay to zero) or "constant"
    weight_decay: NonNegativeFloat = 1e-6
    warmup_steps: NonNegativeInt = 200
    ckpt_every: PositiveInt = 500
    keep_every: NonNegativeInt = 0      # also keep step_<N>.pt every keep_every steps (0: none), e.g. to pick a start
    log_every: PositiveInt = 25
    eval_every: NonNegativeInt = 1000   # 0: evaluate only at the end
    select_inference_steps: PositiveInt = 4  # K whose success_once picks best_model.pt
    eval_inference_steps: list[PositiveInt] = field(default_factory=lambda: [1, 2, 4, 8])
    num_eval_episodes: PositiveInt = 200
    val_seed: NonNegativeInt = 10_000   # env seeds of the periodic evaluations that pick best_model.pt
    eval_seed: NonNegativeInt = 20_000  # env seeds of the final report (demos use seeds from 0: keep these apart)
    num_envs: PositiveInt = 200
    max_episode_steps: PositiveInt = 40
    backend: str = "auto"
    num_threads: NonNegativeInt = 1     # torch CPU threads (0: torch's default); 1 leaves the other cores to the envs
    resume: bool = True
    run_name: str = "default"
    wandb_mode: str = "disabled"

    def __post_init__(self):
        check_fields(self)
        if self.velocity_net not in VELOCITY_NETS:
            raise ValueError(f"velocity_net must be one of {VELOCITY_NETS}, got {self.velocity_net!r}")
        check_act_horizon(self.act_horizon, self.obs_horizon, self.pred_horizon)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.action_norm not in Normalizer.MODES:
            raise ValueError(f"action_norm must be one of {Normalizer.MODES}, got {self.action_norm!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.diffusion_sampler not in SAMPLERS:
            raise ValueError(f"diffusion_sampler must be one of {SAMPLERS}, got {self.diffusion_sampler!r}")
        too_many = [k for k in self.diffusion_eval_steps if k > self.diffusion_steps]
        if too_many:
            raise ValueError(f"diffusion_eval_steps {too_many} exceed diffusion_steps={self.diffusion_steps}: a DDPM "
                             f"samples with at most its training timesteps")
        for k in [*self.eval_inference_steps, self.select_inference_steps]:
            if self.model == "shortcut" and (k > self.shortcut_max_steps or self.shortcut_max_steps % k):
                raise ValueError(f"inference steps {k} must divide shortcut_max_steps={self.shortcut_max_steps}")
            if self.model == "ddpm" and k > self.diffusion_steps:
                raise ValueError(f"inference steps {k} exceed the DDPM's diffusion_steps={self.diffusion_steps}: "
                                 f"sample with at most {self.diffusion_steps} steps or raise diffusion_steps")
        check_obs_mode(self.obs_mode)
        if self.obs_mode != "state" and not self.obs_emb_dim:
            raise ValueError(f"obs_mode {self.obs_mode!r} reads the view through an obs_encoder: set obs_emb_dim > 0 "
                             "(e.g. 64)")


def policy_meta(cfg: ShortCutBCConfig, dataset: ChunkDataset, control_mode: str) -> dict[str, Any]:
    return {"env_id": cfg.env_id, "control_mode": control_mode, "obs_dim": dataset.obs_dim,
            "action_dim": dataset.action_dim, "obs_horizon": cfg.obs_horizon, "pred_horizon": cfg.pred_horizon,
            "act_horizon": cfg.act_horizon, "velocity_net": cfg.velocity_net, "down_dims": list(cfg.down_dims),
            "mlp_dims": list(cfg.mlp_dims), "emb_dim": cfg.emb_dim,
            "obs_emb_dim": cfg.obs_emb_dim, "ema_decay": cfg.ema_decay, "shortcut_max_steps": cfg.shortcut_max_steps,
            "bootstrap_fraction": cfg.bootstrap_fraction, **model_meta(cfg, dataset), **observation_meta(cfg, dataset)}


def diffusion_twin(cfg: ShortCutBCConfig) -> ShortCutBCConfig:
    """``cfg`` as stage 1's diffusion baseline: the same demos, net, optimiser, steps and evaluations, with
    ``model: ddpm`` scored at ``diffusion_eval_steps``: flow and diffusion on equal footing (notebook 01)."""
    steps = sorted(cfg.diffusion_eval_steps, reverse=True)
    select = cfg.select_inference_steps if cfg.select_inference_steps <= cfg.diffusion_steps else steps[-1]
    return dataclasses.replace(cfg, model="ddpm", compare_diffusion=False, eval_inference_steps=steps,
                               select_inference_steps=select)


def model_meta(cfg, dataset) -> dict[str, Any]:
    """The generative model's keys of a policy's metadata: ``model`` (``chunk_policy.MODELS``), and for a DDPM its
    timesteps, sampler and ``diffusion_clip_sample``, the bound its sampler clamps predicted actions to
    (``flowlib.flows.diffusion``): 1 for min-max normalised actions, the demos' largest standardised action
    otherwise.  A flow's are the defaults whatever the diffusion fields say (they do not touch it), so a ShortCut
    resumes and compares as before them."""
    if cfg.model != "ddpm":
        return {**META_DEFAULTS_MODEL, "model": cfg.model}
    if cfg.action_norm == "minmax":
        clip = 1.0
    elif isinstance(dataset, VisualChunkDataset):
        raise ValueError("model ddpm with action_norm meanstd reads every demo window for its clamp, a visual dataset's "
                         "frames too: set action_norm: minmax (Diffusion Policy's) for a visual DDPM")
    else:  # the largest standardised action of any window's chunk [N, H, A]
        clip = round(float(dataset.tensors()[1].abs().max()), 3)
    return {"model": cfg.model, "diffusion_steps": cfg.diffusion_steps, "diffusion_sampler": cfg.diffusion_sampler,
            "diffusion_clip_sample": clip}


def training_demos(path: str | Path) -> list[Episode]:
    """The demonstrations the stage-1 checkpoint at ``path`` was trained on, by its config's ``env_id``,
    ``num_demos`` and ``demo_file`` (generated once and cached, as notebook 01 does): what a method that learns from
    the same data as the flow reads (the Gaussian baseline's cloning, FQL's offline replay)."""
    config = read_checkpoint(path)["config"]
    if "env_id" not in config or "num_demos" not in config:
        raise ValueError(f"{path} does not name the demos it was trained on (env_id, num_demos in its config): "
                         "start from a stage-1 checkpoint of notebook 01")
    from_file = config.get("demo_file") or ""
    demo_path = from_file or generate_demos(config["env_id"], config["num_demos"])
    return load_demos(demo_path, max_episodes=None if from_file else config["num_demos"])


def training_windows(path: str | Path, policy) -> tuple[torch.Tensor, torch.Tensor]:
    """Every training window of ``training_demos(path)``, normalised by ``policy``'s normalisers (a policy or agent
    with ``obs_horizon``, ``pred_horizon``, ``meta["env_id"]``): ``obs [N, To, O]`` and ``chunks [N, H, A]``: what RFC
    mixes into its reflow."""
    dataset = ChunkDataset(training_demos(path), policy.obs_horizon, policy.pred_horizon,
                           gripper=not is_fast(policy.meta["env_id"]))
    return dataset.tensors(policy.obs_normalizer, policy.action_normalizer)


def demo_dataset(cfg) -> tuple[ChunkDataset | VisualChunkDataset, list[Episode]]:
    """Stage 1's training windows from ``cfg``'s demos (``demo_file``, or ``num_demos`` generated and cached) and the
    state episodes they come from; a visual ``obs_mode`` renders the demos into it first (``replay_visual``, cached)."""
    path = cfg.demo_file or generate_demos(cfg.env_id, cfg.num_demos)
    max_episodes = None if cfg.demo_file else cfg.num_demos
    episodes = load_demos(path, max_episodes=max_episodes)
    if cfg.obs_mode == "state":
        return ChunkDataset(episodes, cfg.obs_horizon, cfg.pred_horizon, action_norm=cfg.action_norm,
                            gripper=not is_fast(cfg.env_id)), episodes
    if is_fast(cfg.env_id):
        raise ValueError(f"{cfg.env_id} is a fast torch task with state observations only: set obs_mode: state")
    views = replay_visual(path, cfg.obs_mode, cfg.camera_size, cfg.num_points, max_episodes=max_episodes)
    return VisualChunkDataset(views, cfg.obs_horizon, cfg.pred_horizon, max_episodes=max_episodes,
                              in_memory=cfg.demos_in_memory, action_norm=cfg.action_norm,
                              num_points=cfg.num_points), episodes


def batches(dataset, policy: FlowPolicy, device, random_shift: int = 0):
    """``draw(idx) -> obs [B, To, O], actions [B, H, A]``, normalised as the policy normalises (a resumed checkpoint's
    or stage 1's statistics), on ``device``.  A state dataset's windows are normalised once and indexed; a visual one
    builds each batch's packed frames when asked, its images shifted by up to ``random_shift`` pixels (training only)."""
    if isinstance(dataset, VisualChunkDataset):
        def draw(idx):
            obs, actions = dataset.batch(idx, policy.obs_normalizer, policy.action_normalizer)
            return augment_window(obs, dataset.layout, random_shift).to(device), actions.to(device)
        return draw
    obs_all, act_all = dataset.tensors(policy.obs_normalizer, policy.action_normalizer)  # [N, To, O], [N, H, A]
    return lambda idx: (obs_all[idx], act_all[idx])


def cosine_with_warmup(optimizer, warmup_steps: int, total_steps: int, schedule: str = "cosine"):
    """Linear warm-up to the base LR, then cosine decay to zero (or, ``schedule="constant"``, the base LR):
    ``schedules.warmup_then``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_then, schedule,
                                                                          warmup_steps=warmup_steps,
                                                                          total_steps=total_steps))


def train(cfg, dataset: ChunkDataset, run_path: Path, tracker=None, env=None,
          control_mode: str | None = None, policy: FlowPolicy | None = None,
          weights: torch.Tensor | None = None, extra: dict[str, Any] | None = None,
          checkpoint_format: str = CHECKPOINT_FORMAT) -> tuple[FlowPolicy, dict[str, Any]]:
    """ShortCut BC (or, with ``model: ddpm``, its diffusion twin's) with EMA, AdamW, warm-up + cosine LR; checkpoints
    ``last.pt`` / ``best_model.pt``.

    ``cfg`` is a ``ShortCutBCConfig`` or any config with its training-loop fields (seed,
    train_steps, batch_size, lr, lr_schedule (cosine when absent), weight_decay, warmup_steps, ckpt_every, keep_every, log_every, eval_every,
    num_eval_episodes, val_seed, select_inference_steps, resume).  Stage 2 passes the stage-1 ``policy`` to
    start from, per-sample ``weights`` (``[N]``, aligned with ``dataset.tensors``) and ``extra``
    entries (the critic) stored in every checkpoint.  Trains on CUDA when present, else on CPU.

    With ``cfg.resume`` and an existing ``<run>/last.pt`` of the same settings, training continues
    from its step (a finished run just reloads).  With ``env`` and ``cfg.eval_every``, the EMA policy
    is evaluated periodically; ``best_model.pt`` keeps the best ``success_once`` at
    ``select_inference_steps`` (the last checkpoint if there is no periodic evaluation, a resumed run's too).  With
    ``cfg.keep_every``, ``step_<N>.pt`` is kept every ``keep_every`` steps as well (loadable like ``best_model.pt``);
    writing them draws no random numbers, so the run is the same with or without them.
    """
    run_path = Path(run_path)
    torch.manual_seed(cfg.seed)
    if policy is None:  # the control mode of the env's spec, else the task's
        mode = control_mode or (env.spec.control_mode if env is not None else task_control_mode(cfg.env_id))
        meta = policy_meta(cfg, dataset, mode)
        policy = build_policy(meta, dataset.obs_normalizer, dataset.action_normalizer)
    meta = policy.meta
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy.to(device)  # before the optimiser: a resumed optimiser's moments then load onto the device too
    optimizer = torch.optim.AdamW(policy.flow.net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = cosine_with_warmup(optimizer, cfg.warmup_steps, cfg.train_steps, getattr(cfg, "lr_schedule", "cosine"))
    step, best = 0, {"success_once": -1.0, "step": 0}
    last = run_path / "last.pt"
    save = functools.partial(save_checkpoint, policy=policy, optimizer=optimizer, scheduler=scheduler, cfg=cfg,
                             extra=extra, checkpoint_format=checkpoint_format)
    if cfg.resume and last.exists():
        ckpt = read_checkpoint(last)
        if ckpt["meta"] != meta or ckpt["format"] != checkpoint_format:
            raise ValueError(f"{last} belongs to a run with other settings ({ckpt['meta']}); "
                             "use another run_name or set resume=False to start over")
        policy.flow.load_state_dict(ckpt["flow"])
        policy.obs_normalizer.load_state_dict(ckpt["obs_normalizer"])
        policy.action_normalizer.load_state_dict(ckpt["action_normalizer"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        set_rng_state(ckpt)
        step, best = ckpt["step"], ckpt["best"]
        if tracker is not None and hasattr(tracker, "rewind"):
            tracker.rewind(step)  # rows logged after the checkpoint will be logged again
        print(f"resumed from {last} at step {step}")
    draw = batches(dataset, policy, device, getattr(cfg, "random_shift", 0))
    if weights is not None:
        if weights.shape != (len(dataset),):
            raise ValueError(f"weights must be [{len(dataset)}] (one per dataset window), got {tuple(weights.shape)}")
        if not torch.isfinite(weights).all() or (weights < 0).any():
            raise ValueError("weights must be finite and >= 0: check the critic's advantages and beta")
        weights = weights.to(device)
    policy.train()
    name = "DDPM BC" if meta.get("model") == "ddpm" else "ShortCut BC"
    bar = progress.bar(cfg.train_steps, name if weights is None else "AW-ShortCut", initial=step, unit="step")
    while step < cfg.train_steps:
        idx = torch.randint(0, len(dataset), (cfg.batch_size,))
        obs, actions = draw(idx)  # [B, To, O], [B, H, A], normalised
        loss, info = policy.flow.loss(actions, obs, weight=None if weights is None else weights[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(policy.flow.net.parameters(), 1.0)
        require_finite(grad_norm, "the velocity net's gradient norm", f"step {step}", "lower lr, or check the demos and "
                       "action_norm (a constant action dim scaled by a zero range)")
        optimizer.step()
        scheduler.step()
        policy.flow.update_ema()
        step += 1
        bar.update()
        if tracker is not None and (step % cfg.log_every == 0 or step == cfg.train_steps):
            tracker.log({**info, "grad_norm": grad_norm.item(), "lr": scheduler.get_last_lr()[0]}, step)
        if env is not None and cfg.eval_every and step % cfg.eval_every == 0:
            result = evaluate(policy, env, cfg.num_eval_episodes, cfg.select_inference_steps, seed=cfg.val_seed)
            policy.train()
            if tracker is not None:
                tracker.log({"eval/success_once": result["success_once"], "eval/success_at_end": result["success_at_end"]}, step)
            if result["success_once"] > best["success_once"]:
                best = {"success_once": result["success_once"], "step": step}
                save(run_path / "best_model.pt", step=step, best=best)
        if cfg.keep_every and step % cfg.keep_every == 0:
            save(run_path / f"step_{step}.pt", step=step, best=best)
        if step % cfg.ckpt_every == 0 or step == cfg.train_steps:
            save(last, step=step, best=best)
    bar.close()
    if not (env is not None and cfg.eval_every):  # no periodic evaluation (this part of the run): the last is the best
        save(run_path / "best_model.pt", step=step, best=best)
    policy.eval()
    return policy, best
