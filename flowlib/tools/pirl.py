"""Notebook 04's study (piRL, Chen et al. 2025): the 2D marginal check, chain log-probs against ``K`` and
``a``, and the like-for-like PickCube comparison of noise methods at an equal env-step budget.

The math is in ``flowlib.flows.flow_sde``; the fine-tuning is ``flowlib.methods.stage3.train`` with a noise method.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowlib.flows import flow_sde
from flowlib.infra.config import (
    ConfigError,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    check_fields,
    require,
    validate,
)
from flowlib.infra.metrics import sliced_wasserstein
from flowlib.infra.runs import policy_checkpoint, read_metrics, save_json
from flowlib.infra.tracking import Tracker
from flowlib.methods import stage3
from flowlib.policies import bc

# the comparison's variants: name -> Stage3Config overrides
VARIANTS: dict[str, dict[str, Any]] = {
    "reinflow": {"noise_method": "reinflow"},
    "flow_noise": {"noise_method": "flow_noise"},
    "flow_sde": {"noise_method": "flow_sde"},
    "flow_cps": {"noise_method": "flow_cps"},
    "flow_sde+hybrid": {"noise_method": "flow_sde", "hybrid": True},
    "flow_cps+hybrid": {"noise_method": "flow_cps", "hybrid": True},
}


@dataclass
class FlowSDEConfig:
    """Parameters of notebook 04.  Defaults are the small CPU run (minutes): the noise methods on FastReach from
    its MLP clone (made first when missing), 30 iterations of notebook 03's tutorial settings each;
    ``params/04_flow_sde/fast_reach.yaml`` (3 seeds, 60 iterations) and ``cpu.yaml`` (PickCube) are the comparisons
    reported in docs/results/flow_sde.md."""

    seed: NonNegativeInt = 0
    # 2D: the SDE family against the ODE
    noise_levels: list[NonNegativeFloat] = field(default_factory=lambda: [0.2, 0.5, 1.0])  # SDE noise levels a compared with the ODE
    marginal_steps: PositiveInt = 100      # K of the marginal check
    marginal_samples: PositiveInt = 4000  # samples per marginal comparison
    logprob_steps: list[PositiveInt] = field(default_factory=lambda: [2, 4, 8, 16, 32])  # chain lengths K of the log-probability table
    reflow_train_steps: PositiveInt = 1500  # the trained 2D model (notebook 00's ReFlow on two_moons)
    # a task: noise methods at an equal env-step budget
    init_checkpoint: str = "01_shortcut_bc/fast_reach_mlp/best_model.pt"  # stage-1/2 best_model.pt under outputs/
    methods: list[str] = field(default_factory=lambda: ["reinflow", "flow_noise", "flow_sde", "flow_sde+hybrid"])  # noise methods fine-tuned (reinflow, flow_noise, flow_sde, flow_sde+hybrid)
    seeds: list[NonNegativeInt] = field(default_factory=lambda: [0])  # one fine-tuning run per method and seed
    finetune: dict = field(default_factory=lambda: {  # notebook 03's parameters shared by every method's run
        "env_id": "FastReach-v0", "num_envs": 512, "max_episode_steps": 40, "num_inference_steps": 4,
        "log_prob_over": "executed_last", "max_noise_std": 0.1, "final_noise_std": 0.04, "min_noise_std": 0.02,
        "noise_decay_steps": 10_000_000, "noise_level": 0.15, "total_env_steps": 1_228_800, "rollout_steps": 10,
        "update_epochs": 5, "minibatch_size": 2048, "actor_lr": 1e-4, "critic_lr": 1e-3, "target_kl": 0.05,
        "critic_warmup_steps": 81_920, "eval_every": 10, "num_eval_episodes": 512, "ckpt_every": 10})
    num_threads: NonNegativeInt = 1
    resume: bool = True
    run_name: str = "default"
    wandb_mode: str = "disabled"

    def __post_init__(self):
        check_fields(self)
        unknown = [m for m in self.methods if m not in VARIANTS]
        require([
            (not unknown, f"unknown methods {unknown}; choose from {sorted(VARIANTS)}"),
            (bool(self.methods) and bool(self.seeds), "methods and seeds must not be empty"),
        ])
        for key in ("noise_method", "hybrid", "seed", "run_name", "init_checkpoint", "resume", "wandb_mode"):
            if key in self.finetune:
                raise ConfigError(f"finetune: {key!r} is set by the comparison itself; remove it from finetune")
        self.finetune_config("reinflow", 0)  # unknown or badly typed finetune keys fail now, not mid-run

    @property
    def env_id(self) -> str:
        """The task of the comparison (``finetune``'s ``env_id``, else stage 3's default)."""
        return self.finetune.get("env_id", stage3.Stage3Config.env_id)

    def finetune_config(self, method: str, seed: int) -> stage3.Stage3Config:
        """The ``Stage3Config`` of one comparison run: ``finetune`` + the method's overrides + the seed."""
        values = {**self.finetune, **VARIANTS[method], "seed": seed, "init_checkpoint": self.init_checkpoint,
                  "run_name": f"{method.replace('+', '_')}_s{seed}", "resume": self.resume}
        return validate(stage3.Stage3Config, values, source="finetune")


# --------------------------------------------------------------------------- 2D


def marginal_table(velocity_fn, num_steps: int, noise_levels: list[float], n: int, seed: int = 0,
                   method: str = "flow_sde") -> list[dict]:
    """SDE samples at each noise level ``a`` against ODE samples (sliced Wasserstein-1), with the distance
    between two independent ODE sample sets of the same size as the yardstick; also how far one path moves
    (mean ``||x_1^SDE - x_1^ODE||`` from the same ``x_0``).  ``velocity_fn(x, t) -> velocity``."""
    g = lambda s: torch.Generator().manual_seed(seed * 1000 + s)
    x0 = torch.randn(n, 2, generator=g(0))
    ode, _ = flow_sde.sample_chain(velocity_fn, x0, num_steps, method)
    ode2, _ = flow_sde.sample_chain(velocity_fn, torch.randn(n, 2, generator=g(1)), num_steps, method)
    yardstick = sliced_wasserstein(ode[:, -1], ode2[:, -1])
    rows = []
    mask = flow_sde.full_mask(n, num_steps, flow_sde.stochastic_steps(method, num_steps))
    for i, a in enumerate(noise_levels):
        sde, _ = flow_sde.sample_chain(velocity_fn, x0, num_steps, method, a, mask, g(2 + i))
        dist = sliced_wasserstein(sde[:, -1], ode[:, -1])
        rows.append({"a": a, "K": num_steps, "sw_sde_vs_ode": dist, "sw_ode_vs_ode": yardstick,
                     "ratio": dist / yardstick, "within_1.5x": dist <= 1.5 * yardstick,
                     "path_moved": float((sde[:, -1] - ode[:, -1]).norm(dim=1).mean())})
    return rows


def log_prob_table(velocity_fn, steps: list[int], noise_levels: list[float], n: int = 2000, seed: int = 0,
                   method: str = "flow_sde") -> list[dict]:
    """Joint log-probs of SDE chains (sum over the stochastic steps) for each ``K`` and ``a``: mean and spread
    per chain and per step, and the log-prob of the one step a hybrid chain would score."""
    rows = []
    for K in steps:
        eligible = flow_sde.stochastic_steps(method, K)
        if eligible < 1:
            continue
        for a in noise_levels:
            if a == 0:
                continue
            gen = torch.Generator().manual_seed(seed)
            x0 = torch.randn(n, 2, generator=gen)
            _, step_lp = flow_sde.sample_chain(velocity_fn, x0, K, method, a, flow_sde.full_mask(n, K, eligible), gen)
            joint = step_lp.sum(1)
            rows.append({"K": K, "a": a, "log_prob_mean": float(joint.mean()), "log_prob_std": float(joint.std()),
                         "per_step_mean": float(joint.mean()) / eligible,
                         "first_step_mean": float(step_lp[:, 0].mean()), "last_step_mean": float(step_lp[:, eligible - 1].mean())})
    return rows


# --------------------------------------------------------------------------- PickCube


def init_checkpoint_path(cfg: FlowSDEConfig) -> Path:
    """The stage-1/2 ``best_model.pt`` the comparison starts from (``FileNotFoundError`` if missing)."""
    return policy_checkpoint(cfg.init_checkpoint, "init_checkpoint")


def evaluate_start(cfg: FlowSDEConfig, env, run_path: Path) -> dict[str, Any]:
    """Success of the starting checkpoint's deterministic chain on the held-out eval seeds.  The ODE chain
    is the same for every noise method, so this runs once per comparison (cached in ``before.json``)."""
    path = Path(run_path) / "before.json"
    if cfg.resume and path.exists():
        return json.loads(path.read_text())
    rcfg = cfg.finetune_config(cfg.methods[0], cfg.seeds[0])
    agent, _ = stage3.build_agent(rcfg, stage3.init_checkpoint_path(rcfg), env.spec)
    result = bc.evaluate(agent, env, rcfg.num_eval_episodes, rcfg.num_inference_steps, seed=rcfg.eval_seed)
    before = {k: result[k] for k in ("success_once", "success_at_end", "episodes")}
    save_json(path, before)
    return before


def run_method(cfg: FlowSDEConfig, method: str, seed: int, env, run_path: Path, before: dict) -> dict[str, Any]:
    """One fine-tuning run from the starting checkpoint, then the deterministic chain on the same held-out
    seeds as ``before``.  Resumable: a run whose ``summary.json`` exists is read back, not repeated.
    Returns its summary and metrics rows."""
    rcfg = cfg.finetune_config(method, seed)
    path = Path(run_path) / rcfg.run_name
    done = path / "summary.json"
    if cfg.resume and done.exists():
        return {**json.loads(done.read_text()), "rows": read_metrics(path)}
    torch.manual_seed(seed)
    agent, _ = stage3.build_agent(rcfg, stage3.init_checkpoint_path(rcfg), env.spec)
    tracker = Tracker(path, dataclasses.asdict(rcfg), wandb_mode=cfg.wandb_mode, project="flowlib-04",
                      resume=rcfg.resume)
    t0 = time.time()
    out = stage3.train(rcfg, agent, env, path, tracker)
    train_time = time.time() - t0
    after = bc.evaluate(agent, env, rcfg.num_eval_episodes, rcfg.num_inference_steps, seed=rcfg.eval_seed)
    summary = {"method": method, "seed": seed, "env_steps": out["env_steps"], "train_time_s": train_time,
               "before": before["success_once"], "after": after["success_once"],
               "after_at_end": after["success_at_end"]}
    tracker.summary(summary)
    tracker.finish()
    return {**summary, "rows": tracker.rows}


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value)."""
    v = np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0
