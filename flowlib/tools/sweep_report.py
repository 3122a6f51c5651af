"""Reading a sweep (``flowlib.tools.sweep``) back: notebook 05's parameters, every finished job's metrics and summary,
and the per-setting table over seeds (time to a success level, final success and its gain, stability, cost).
The paired verdicts of a sweep's settings on shared held-out episodes are ``flowlib.tools.verdicts``'.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from flowlib.infra.config import ConfigError, Fraction, NonNegativeInt, check_fields
from flowlib.infra.runs import REPO_ROOT, read_metrics
from flowlib.tools.sweep import Job


@dataclass
class SweepReportConfig:
    """Parameters of notebook 05 (the sweep report)."""

    sweep_dir: str = ""                 # relative to outputs/ (e.g. 03_reinflow/ablations); "" runs the smoke sweep
    smoke_params: str = "params/03_reinflow/smoke"  # folder of params files the smoke sweep runs when sweep_dir is empty
    seeds: list[NonNegativeInt] = field(default_factory=lambda: [0])  # seeds of the smoke sweep
    success_level: Fraction = 0.9  # success a run must reach to count as solved (time-to-level column)
    metric: str = "train/success_once"  # the logged column the report compares
    evaluation: str = ""  # results/<record> of the sweep's checkpoints on shared held-out episodes: paired verdicts
    baseline: str = "baseline"  # the setting the verdicts compare every other with
    run_name: str = "default"

    def __post_init__(self):
        check_fields(self)
        if self.evaluation and not (REPO_ROOT / "results" / self.evaluation / "per_episode.csv").is_file():
            raise ConfigError(f"evaluation {self.evaluation!r}: no results/{self.evaluation}/per_episode.csv; publish "
                              "the sweep's evaluation first (python -m flowlib.results publish outputs/evaluate/<run> "
                              f"--as {self.evaluation}), or leave evaluation empty")



def category(variant: str) -> str:
    """``noise_exp`` -> ``noise``; the ablation files are named ``<category>_<variant>``."""
    return variant.split("_", 1)[0]


def load_sweep(sweep_dir: str | Path):
    """Every finished job's metrics as one DataFrame: ``job, variant, category, seed`` + logged columns,
    and one row per job of its summary (``before`` / ``after`` success, train time)."""

    sweep_dir = Path(sweep_dir)
    meta_path = sweep_dir / "sweep.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: run a sweep first (python -m flowlib.sweep run ...)")
    curves, finals, failed = [], [], []
    for j in json.loads(meta_path.read_text())["jobs"]:
        job = Job(**j)
        if not job.finished:
            if job.failed:
                failed.append(job)
            continue
        variant = Path(job.params_file).stem
        tags = {"job": job.name, "variant": variant, "category": category(variant), "seed": job.seed}
        out = Path(job.out_dir)
        curves += [{**tags, **row} for row in read_metrics(out)]
        summary = json.loads((out / "summary.json").read_text())
        finals.append({**tags, "before": summary["before"]["success_once"], "after": summary["after"]["success_once"],
                       "train_time_s": summary["train_time_s"], "env_steps": summary["env_steps"]})
    if not finals:
        why = ""
        if failed:  # e.g. every job stopped at a missing start checkpoint: say so, not only "see monitor"
            first = (Path(failed[0].out_dir) / "error.txt").read_text().strip().splitlines()
            why = f"; {len(failed)} failed, {failed[0].name} with: {first[-1] if first else '?'}"
        raise ValueError(f"{sweep_dir} has no finished job yet{why} (see python -m flowlib.sweep monitor {sweep_dir})")
    return pd.DataFrame(curves), pd.DataFrame(finals)


def summarize(curves, finals, level: float = 0.9, metric: str = "train/success_once"):
    """Per variant, over seeds: env steps to first reach ``level`` of ``metric`` (mean; NaN if a
    seed never does, and how many did), final deterministic success (mean, std), its gain over the
    same run's start on the same episodes (mean, std), stability (std of the metric over the second
    half of the run, mean over seeds) and seconds per iteration."""

    rows = []
    for (variant, cat), runs in finals.groupby(["variant", "category"]):
        reach, stability, per_iter = [], [], []
        for job in runs.job:
            c = curves[curves.job == job].sort_values("step")
            m = c[metric].dropna() if metric in c else pd.Series(dtype=float)
            hit = c.loc[m.index[m >= level], "step"] if len(m) else []
            reach.append(float(hit.iloc[0]) if len(hit) else np.nan)
            second = m.iloc[len(m) // 2:]
            stability.append(float(second.std()) if len(second) > 1 else np.nan)
            per_iter.append(float((c.rollout_time + c.update_time).mean()))
        rows.append({"category": cat, "variant": variant, "seeds": len(runs),
                     f"steps_to_{level:g}": np.nanmean(reach) if not np.isnan(reach).all() else np.nan,
                     "seeds_reaching": int((~np.isnan(reach)).sum()),
                     "final_success_mean": runs.after.mean(), "final_success_std": runs.after.std(ddof=0),
                     "gain_mean": (runs.after - runs.before).mean(), "gain_std": (runs.after - runs.before).std(ddof=0),
                     "stability_std": np.nanmean(stability) if not np.isnan(stability).all() else np.nan,
                     "s_per_iteration": float(np.mean(per_iter))})
    return pd.DataFrame(rows).sort_values(["category", "variant"]).reset_index(drop=True)
