"""Stage 1: ShortCut Flow behaviour cloning of action chunks.

A ``FlowPolicy`` is a ``flowlib.flows.ShortCut`` model over normalised action chunks ``[B, H, A]``
(``ShortCutVelocityUNet1D``) conditioned on a normalised observation window ``[B, To, O]``, plus
the normalisers and horizons.  It acts by integrating the flow ODE from seeded noise in ``K`` steps
(deterministic given the noise) and executing ``act_horizon`` actions of the chunk.

Checkpoints (``last.pt``, ``best_model.pt``) are written atomically and hold everything needed to
rebuild the policy and resume training: model + EMA, optimiser, scheduler, normalisers, step,
config, RNG state and the env/dims metadata that ``load_policy`` checks against an env.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from . import progress
from .config import Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_fields
from .data import ChunkDataset, Episode, Normalizer, generate_demos, load_demos
from .encoders import build_obs_encoder
from .envs import control_mode as task_control_mode
from .envs import is_fast
from .flows import ShortCut
from .guards import require_finite
from .policy_eval import evaluate  # noqa: F401  (bc.evaluate: what every stage scores a policy with)
from .runs import load_torch, rng_state, save_torch, set_rng_state
from .schedules import LR_SCHEDULES, warmup_then
from .unet import ChunkVelocityMLP, ShortCutVelocityUNet1D
from .visual import augment_window, check_obs_mode
from .visual_demos import VisualChunkDataset, replay_visual

CHECKPOINT_FORMAT = "flowlib.shortcut_bc/1"
AW_CHECKPOINT_FORMAT = "flowlib.aw_shortcut/1"  # stage 2: the same contents plus its critic
POLICY_FORMATS = (CHECKPOINT_FORMAT, AW_CHECKPOINT_FORMAT)


def check_act_horizon(act_horizon: int, obs_horizon: int, pred_horizon: int) -> int:
    """``act_horizon`` if a predicted chunk has that many actions to execute (``chunk[To-1 : To-1+Ta]``)."""
    limit = pred_horizon - obs_horizon + 1
    if not 1 <= act_horizon <= limit:
        raise ValueError(f"act_horizon={act_horizon} is outside [1, {limit}] (pred_horizon - obs_horizon + 1): "
                         "the predicted chunk has no actions beyond it")
    return act_horizon


@dataclass
class ShortCutBCConfig:
    """Parameters of notebook 01 (ShortCut BC). Defaults are the small CPU run."""

    seed: NonNegativeInt = 0
    env_id: str = "PickCube-v1"
    num_demos: PositiveInt = 20
    demo_file: str = ""                 # an existing ManiSkill .h5 (state, pd_ee_delta_pos); "" means generate
    obs_horizon: PositiveInt = 2
    pred_horizon: PositiveInt = 16
    act_horizon: PositiveInt = 8
    action_norm: str = "minmax"         # "minmax" (to [-1, 1], Diffusion Policy's) or "meanstd" (standardised)
    velocity_net: str = "unet"          # "unet" (1D temporal U-Net over the chunk) or "mlp" (one flat MLP, ReinFlow's)
    down_dims: list[PositiveInt] = field(default_factory=lambda: [32, 64])  # the U-Net's channel widths
    mlp_dims: list[PositiveInt] = field(default_factory=lambda: [256, 256, 256])  # the MLP's layer widths
    emb_dim: PositiveInt = 32  # width of the time and step-size embeddings
    obs_emb_dim: NonNegativeInt = 0     # 0: the flat obs window conditions the U-Net; > 0: an MLP obs_encoder first
    obs_mode: str = "state"             # "state", or from the task camera "rgb", "rgbd", "pointcloud" (flowlib.visual)
    camera_size: PositiveInt = 64       # the camera's width and height in pixels (visual obs modes)
    num_points: PositiveInt = 512       # points per point-cloud frame (obs_mode pointcloud)
    random_shift: NonNegativeInt = 4    # DrQ's image augmentation: pad and re-crop by up to this many pixels (0: off)
    demos_in_memory: bool = True        # visual demos: read every frame once; false: stream each batch's from disk
    shortcut_max_steps: PositiveInt = 8  # the finest ShortCut step d_min is 1 / shortcut_max_steps
    bootstrap_fraction: Fraction = 0.25  # share of each batch given the ShortCut self-consistency target
    ema_decay: Fraction = 0.995
    train_steps: PositiveInt = 300
    batch_size: PositiveInt = 128
    lr: PositiveFloat = 1e-3
    lr_schedule: str = "cosine"         # after the warm-up: "cosine" (decay to zero) or "constant"
    weight_decay: NonNegativeFloat = 1e-6
    warmup_steps: NonNegativeInt = 50
    ckpt_every: PositiveInt = 100
    keep_every: NonNegativeInt = 0      # also keep step_<N>.pt every keep_every steps (0: none), e.g. to pick a start
    log_every: PositiveInt = 25
    eval_every: NonNegativeInt = 0      # 0: evaluate only at the end
    select_inference_steps: PositiveInt = 4  # K whose success_once picks best_model.pt
    eval_inference_steps: list[PositiveInt] = field(default_factory=lambda: [1, 2, 4, 8])
    num_eval_episodes: PositiveInt = 4
    val_seed: NonNegativeInt = 10_000   # env seeds of the periodic evaluations that pick best_model.pt
    eval_seed: NonNegativeInt = 20_000  # env seeds of the final report (demos use seeds from 0: keep these apart)
    num_envs: PositiveInt = 2
    max_episode_steps: PositiveInt = 100
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
        for k in [*self.eval_inference_steps, self.select_inference_steps]:
            if k > self.shortcut_max_steps or self.shortcut_max_steps % k:
                raise ValueError(f"inference steps {k} must divide shortcut_max_steps={self.shortcut_max_steps}")
        check_obs_mode(self.obs_mode)
        if self.obs_mode != "state" and not self.obs_emb_dim:
            raise ValueError(f"obs_mode {self.obs_mode!r} reads the view through an obs_encoder: set obs_emb_dim > 0 "
                             "(e.g. 64)")


class ChunkPolicy(nn.Module):
    """What ``evaluate`` runs: ``act(window [N, To, O], num_steps, x0=...)`` -> the chunk to execute ``[N, Ta, A]``
    (raw units), and, for a closed-loop policy (``closed_loop``), ``correct_step(window, action [N, A])`` -> the
    action that runs, from the window current at that step.  A chunk policy runs its chunk open loop."""

    closed_loop = False

    def correct_step(self, obs_window: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return action


class FlowPolicy(ChunkPolicy):
    """ShortCut flow over action chunks + normalisers; ``act`` maps raw obs windows to raw actions."""

    def __init__(self, flow: ShortCut, obs_normalizer: Normalizer, action_normalizer: Normalizer, meta: dict[str, Any]):
        super().__init__()
        self.flow, self.obs_normalizer, self.action_normalizer, self.meta = flow, obs_normalizer, action_normalizer, meta
        self.obs_horizon, self.pred_horizon, self.act_horizon = meta["obs_horizon"], meta["pred_horizon"], meta["act_horizon"]
        self.action_dim = meta["action_dim"]

    @torch.no_grad()
    def sample_chunk(self, obs_window: torch.Tensor, num_steps: int, generator: torch.Generator | None = None,
                     use_ema: bool = True, x0: torch.Tensor | None = None) -> torch.Tensor:
        """Raw ``obs_window [N, To, O]`` -> raw action chunk ``[N, H, A]`` by ``num_steps`` ODE steps
        from ``x0 [N, H, A]`` (drawn from ``generator`` when not given)."""
        N = obs_window.shape[0]
        if x0 is None:
            x0 = torch.randn(N, self.pred_horizon, self.action_dim, generator=generator)
        return self.chunk(obs_window, x0, num_steps, use_ema)

    def chunk(self, obs_window: torch.Tensor, x0: torch.Tensor, num_steps: int, use_ema: bool = True) -> torch.Tensor:
        """``sample_chunk`` from a given ``x0 [N, H, A]``, differentiable in ``x0``: the map from latent noise to
        raw actions that steering ``x_0`` (DSRL) acts through.  Computed, and returned, on the policy's device."""
        device = self.action_normalizer.shift.device  # the policy's: raw windows may come from CPU envs
        x = self.flow.integrate(x0.to(device), num_steps, obs=self.obs_normalizer.normalize(obs_window.to(device)),
                                use_ema=use_ema)
        return self.action_normalizer.unnormalize(x)

    def act(self, obs_window: torch.Tensor, num_steps: int, generator: torch.Generator | None = None,
            x0: torch.Tensor | None = None) -> torch.Tensor:
        """The ``act_horizon`` actions to execute now: ``chunk[To - 1 : To - 1 + act_horizon]``, ``[N, Ta, A]``."""
        start = self.obs_horizon - 1
        return self.sample_chunk(obs_window, num_steps, generator, x0=x0)[:, start:start + self.act_horizon]


def build_policy(meta: dict[str, Any], obs_normalizer: Normalizer | None = None,
                 action_normalizer: Normalizer | None = None) -> FlowPolicy:
    """A fresh policy from checkpoint metadata (dims, horizons, net and ShortCut sizes, the obs mode's encoder).  The
    policy keeps copies of the normalisers it is given: moving it to a GPU leaves the dataset's (and a critic built
    from them) on the CPU."""
    dims = (meta["action_dim"], meta["obs_dim"], meta["obs_horizon"], meta["pred_horizon"])
    encoder = build_obs_encoder(meta)  # None for a state policy
    if meta["velocity_net"] == "mlp":
        net = ChunkVelocityMLP(*dims, hidden=tuple(meta["mlp_dims"]), emb_dim=meta["emb_dim"],
                               obs_emb_dim=meta["obs_emb_dim"], obs_encoder=encoder)
    else:
        net = ShortCutVelocityUNet1D(*dims, down_dims=tuple(meta["down_dims"]), emb_dim=meta["emb_dim"],
                                     obs_emb_dim=meta["obs_emb_dim"], obs_encoder=encoder)
    flow = ShortCut(net, ema_decay=meta["ema_decay"], max_steps=meta["shortcut_max_steps"],
                    bootstrap_fraction=meta["bootstrap_fraction"])
    obs_normalizer = Normalizer(meta["obs_dim"]) if obs_normalizer is None else copy.deepcopy(obs_normalizer)
    action_normalizer = Normalizer(meta["action_dim"]) if action_normalizer is None else copy.deepcopy(action_normalizer)
    return FlowPolicy(flow, obs_normalizer, action_normalizer, meta)


def policy_meta(cfg: ShortCutBCConfig, dataset: ChunkDataset, control_mode: str) -> dict[str, Any]:
    return {"env_id": cfg.env_id, "control_mode": control_mode, "obs_dim": dataset.obs_dim,
            "action_dim": dataset.action_dim, "obs_horizon": cfg.obs_horizon, "pred_horizon": cfg.pred_horizon,
            "act_horizon": cfg.act_horizon, "velocity_net": cfg.velocity_net, "down_dims": list(cfg.down_dims),
            "mlp_dims": list(cfg.mlp_dims), "emb_dim": cfg.emb_dim,
            "obs_emb_dim": cfg.obs_emb_dim, "ema_decay": cfg.ema_decay, "shortcut_max_steps": cfg.shortcut_max_steps,
            "bootstrap_fraction": cfg.bootstrap_fraction, **observation_meta(cfg, dataset)}


def observation_meta(cfg, dataset) -> dict[str, Any]:
    """What a policy's observations are: ``obs_mode``, and for a visual one the packed layout, camera and points."""
    mode = getattr(cfg, "obs_mode", "state")
    if mode == "state":
        return dict(META_DEFAULTS_OBS)
    return {"obs_mode": mode, "obs_layout": dataset.layout.to_dict(), "camera_size": dataset.camera_size,
            "num_points": dataset.num_points}


def check_compatible(meta: dict[str, Any], spec) -> None:
    """Stop with a clear message if a checkpoint does not fit an env (``flowlib.envs.EnvSpec``)."""
    if meta["env_id"] != spec.env_id:
        raise ValueError(f"checkpoint was trained on {meta['env_id']}, env is {spec.env_id}: "
                         f"make the env with env_id={meta['env_id']!r} or train a policy for {spec.env_id}")
    trained, given = meta.get("obs_mode", "state"), getattr(spec, "obs_mode", "state")
    if trained != given:
        raise ValueError(f"checkpoint reads obs_mode={trained!r} observations, the env gives {given!r}: make the env "
                         f"with make_env(..., **flowlib.visual.policy_env_kwargs(meta))")
    for key in ("obs_dim", "action_dim"):
        if meta[key] != getattr(spec, key):
            raise ValueError(f"checkpoint {key}={meta[key]} but the env has {key}={getattr(spec, key)} "
                             f"({spec.env_id}, control_mode={spec.control_mode}); use the obs/control mode it was trained with "
                             f"({meta['control_mode']}, state obs)")
    if meta["control_mode"] != spec.control_mode:
        raise ValueError(f"checkpoint uses control_mode={meta['control_mode']}, env {spec.control_mode}")


def save_checkpoint(path: Path, policy: FlowPolicy, optimizer, scheduler, step: int, cfg,
                    best: dict[str, Any], extra: dict[str, Any] | None = None,
                    checkpoint_format: str = CHECKPOINT_FORMAT) -> Path:
    return save_torch({
        **(extra or {}), "format": checkpoint_format, "step": step, "config": dataclasses.asdict(cfg), "meta": policy.meta,
        "flow": policy.flow.state_dict(), "obs_normalizer": policy.obs_normalizer.state_dict(),
        "action_normalizer": policy.action_normalizer.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "best": best, **rng_state(),
    }, path)


# Metadata keys added after the first checkpoints were written, with the value those checkpoints mean.
META_DEFAULTS_OBS = {"obs_mode": "state", "obs_layout": None, "camera_size": 0, "num_points": 0}
META_DEFAULTS = {"obs_emb_dim": 0, "velocity_net": "unet", "mlp_dims": [256, 256, 256], **META_DEFAULTS_OBS}
VELOCITY_NETS = ("unet", "mlp")


def features_dim(meta: dict[str, Any]) -> int:
    """The width of the velocity net's features (``return_features``): the U-Net's bottleneck or the MLP's last layer."""
    return meta["mlp_dims"][-1] if meta["velocity_net"] == "mlp" else meta["down_dims"][-1]


def complete_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with the keys of ``META_DEFAULTS`` it lacks: an older checkpoint loads, resumes and compares as
    the same policy written today."""
    return {**META_DEFAULTS, **meta}


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    ckpt = load_torch(path, "train one with notebook 01 (python -m flowlib.run 01_shortcut_bc) or check the run folder")
    if not isinstance(ckpt, dict) or ckpt.get("format") not in POLICY_FORMATS:
        raise ValueError(f"{path} is not a flowlib flow-policy checkpoint (formats {POLICY_FORMATS})")
    return {**ckpt, "meta": complete_meta(ckpt["meta"])}


def checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """A policy checkpoint's ``meta``, read once per file version: a sweep checks dozens of jobs against one start."""
    path = Path(path)
    return _meta(str(path), path.stat().st_mtime)


@functools.lru_cache(maxsize=8)
def _meta(path: str, mtime: float) -> dict[str, Any]:
    return read_checkpoint(path)["meta"]


def load_policy(path: str | Path, spec=None) -> FlowPolicy:
    """Rebuild a policy from a checkpoint; with an env ``spec``, check they fit."""
    ckpt = read_checkpoint(path)
    if spec is not None:
        check_compatible(ckpt["meta"], spec)
    policy = build_policy(ckpt["meta"])
    policy.flow.load_state_dict(ckpt["flow"])
    policy.obs_normalizer.load_state_dict(ckpt["obs_normalizer"])
    policy.action_normalizer.load_state_dict(ckpt["action_normalizer"])
    return policy.eval()


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
    """ShortCut BC with EMA, AdamW, warm-up + cosine LR; checkpoints ``last.pt`` / ``best_model.pt``.

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
    bar = progress.bar(cfg.train_steps, "ShortCut BC" if weights is None else "AW-ShortCut", initial=step,
                       unit="step")
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
