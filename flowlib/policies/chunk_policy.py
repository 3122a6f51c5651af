"""The chunk-policy protocol and the flow policy's checkpoint format: what every stage acts with and loads.

``ChunkPolicy`` is what ``flowlib.policies.policy_eval.evaluate`` runs; ``FlowPolicy`` is stage 1's (and stage 2's) ShortCut
flow over normalised action chunks ``[B, H, A]`` conditioned on a normalised observation window ``[B, To, O]``, plus
the normalisers and horizons.  It acts by integrating the flow ODE from seeded noise in ``K`` steps (deterministic
given the noise) and executing ``act_horizon`` actions of the chunk.

Checkpoints (``last.pt``, ``best_model.pt``) are written atomically and hold everything needed to rebuild the policy
and resume training: model + EMA, optimiser, scheduler, normalisers, step, config, RNG state and the env/dims
metadata that ``load_policy`` checks against an env.  Stage 1's training loop is ``flowlib.policies.bc``.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from flowlib.envs.data import Normalizer
from flowlib.flows.diffusion import DDPM
from flowlib.flows.models import METHODS as FLOW_MODELS
from flowlib.flows.models import ShortCut
from flowlib.flows.unet import ChunkVelocityMLP, ShortCutVelocityUNet1D
from flowlib.infra.runs import load_torch, rng_state, save_torch
from flowlib.policies.encoders import build_obs_encoder

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


class ChunkPolicy(nn.Module):
    """What ``evaluate`` runs: ``act(window [N, To, O], num_steps, x0=...)`` -> the chunk to execute ``[N, Ta, A]``
    (raw units), and, for a closed-loop policy (``closed_loop``), ``correct_step(window, action [N, A])`` -> the
    action that runs, from the window current at that step.  A chunk policy runs its chunk open loop."""

    closed_loop = False

    def correct_step(self, obs_window: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return action


class FlowPolicy(ChunkPolicy):
    """ShortCut flow over action chunks + normalisers; ``act`` maps raw obs windows to raw actions.  With
    ``meta["model"] == "ddpm"``, ``flow`` is stage 1's diffusion baseline (``flowlib.flows.diffusion.DDPM``) behind the
    same interface: ``num_steps`` are its denoising steps, by its ``flow.sampler``."""

    def __init__(self, flow: ShortCut | DDPM, obs_normalizer: Normalizer, action_normalizer: Normalizer,
                 meta: dict[str, Any]):
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
    meta = complete_meta(meta)
    dims = (meta["action_dim"], meta["obs_dim"], meta["obs_horizon"], meta["pred_horizon"])
    encoder = build_obs_encoder(meta)  # None for a state policy
    if meta["velocity_net"] == "mlp":
        net = ChunkVelocityMLP(*dims, hidden=tuple(meta["mlp_dims"]), emb_dim=meta["emb_dim"],
                               obs_emb_dim=meta["obs_emb_dim"], obs_encoder=encoder)
    else:
        net = ShortCutVelocityUNet1D(*dims, down_dims=tuple(meta["down_dims"]), emb_dim=meta["emb_dim"],
                                     obs_emb_dim=meta["obs_emb_dim"], obs_encoder=encoder)
    flow = flow_model(meta, net, meta["ema_decay"])
    obs_normalizer = Normalizer(meta["obs_dim"]) if obs_normalizer is None else copy.deepcopy(obs_normalizer)
    action_normalizer = Normalizer(meta["action_dim"]) if action_normalizer is None else copy.deepcopy(action_normalizer)
    return FlowPolicy(flow, obs_normalizer, action_normalizer, meta)


def flow_model(meta: dict[str, Any], net: nn.Module, ema_decay: float | None) -> ShortCut | DDPM:
    """The stage-1 model ``meta["model"]`` names (its loss and sampler) around ``net``; ``ema_decay`` None or 0: no
    EMA copy (RFC's reflow trains the live net; stage 1 without EMA).  ``meta`` as ``complete_meta`` leaves it."""
    ema_decay = ema_decay or None
    if meta["model"] in ("reflow", "meanflow"):
        return FLOW_MODELS[meta["model"]](net, ema_decay=ema_decay)
    if meta["model"] == "ddpm":
        return DDPM(net, ema_decay=ema_decay, num_train_timesteps=meta["diffusion_steps"],
                    clip_range=float(meta["diffusion_clip_sample"]), sampler=meta["diffusion_sampler"])
    return ShortCut(net, ema_decay=ema_decay, max_steps=meta["shortcut_max_steps"],
                    bootstrap_fraction=meta["bootstrap_fraction"])


def observation_meta(cfg, dataset) -> dict[str, Any]:
    """What a policy's observations are: ``obs_mode``, and for a visual one the packed layout, camera and points."""
    mode = getattr(cfg, "obs_mode", "state")
    if mode == "state":
        return dict(META_DEFAULTS_OBS)
    return {"obs_mode": mode, "obs_layout": dataset.layout.to_dict(), "camera_size": dataset.camera_size,
            "num_points": dataset.num_points}


def check_compatible(meta: dict[str, Any], spec) -> None:
    """Stop with a clear message if a checkpoint does not fit an env (``flowlib.envs.maniskill.EnvSpec``)."""
    if meta["env_id"] != spec.env_id:
        raise ValueError(f"checkpoint was trained on {meta['env_id']}, env is {spec.env_id}: "
                         f"make the env with env_id={meta['env_id']!r} or train a policy for {spec.env_id}")
    trained, given = meta.get("obs_mode", "state"), getattr(spec, "obs_mode", "state")
    if trained != given:
        raise ValueError(f"checkpoint reads obs_mode={trained!r} observations, the env gives {given!r}: make the env "
                         f"with make_env(..., **flowlib.envs.visual.policy_env_kwargs(meta))")
    for key in ("obs_dim", "action_dim"):
        if meta[key] != getattr(spec, key):
            raise ValueError(f"checkpoint {key}={meta[key]} but the env has {key}={getattr(spec, key)} "
                             f"({spec.env_id}, control_mode={spec.control_mode}); use the obs/control mode it was trained with "
                             f"({meta['control_mode']}, state obs)")
    if meta["control_mode"] != spec.control_mode:
        raise ValueError(f"checkpoint uses control_mode={meta['control_mode']}, env {spec.control_mode}")


def flow_problem(meta: dict[str, Any], path, user: str) -> str:
    """Why ``user`` (a stage or a method) cannot start from the policy at ``path`` (its ``meta``): it is not a
    ShortCut flow but another of stage 1's models ("" when it is)."""
    model = meta.get("model", "shortcut")
    if model == "shortcut":
        return ""
    return (f"{path} is stage 1's {MODEL_NAMES[model]} (model: {model}); {user} reads a ShortCut flow (its ODE, "
            f"velocity or x_0 map): start from a stage-1 run with model: shortcut")


def require_flow(meta: dict[str, Any], path, user: str) -> None:
    """``flow_problem`` as a ``ValueError``: where a stage loads its start."""
    if problem := flow_problem(meta, path, user):
        raise ValueError(problem)


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
META_DEFAULTS_MODEL = {"model": "shortcut", "diffusion_steps": 100, "diffusion_sampler": "ddim",
                       "diffusion_clip_sample": True}
META_DEFAULTS = {"obs_emb_dim": 0, "velocity_net": "unet", "mlp_dims": [256, 256, 256], **META_DEFAULTS_MODEL,
                 **META_DEFAULTS_OBS}
VELOCITY_NETS = ("unet", "mlp")
# the generative model over chunks: the ShortCut flow; plain flow matching and MeanFlow (flowlib.flows.models, stage 1
# only); the diffusion baseline (flowlib.flows.diffusion)
MODELS = ("shortcut", "reflow", "meanflow", "ddpm")
MODEL_NAMES = {"shortcut": "ShortCut flow", "reflow": "plain flow-matching (ReFlow) policy",
               "meanflow": "MeanFlow policy", "ddpm": "diffusion baseline"}


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
