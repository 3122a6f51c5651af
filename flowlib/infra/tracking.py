"""Metric tracking: always to files in the run folder, optionally to Weights & Biases.

W&B is off by default (``wandb_mode="disabled"``).  ``"offline"`` writes a W&B run under
``<run>/wandb`` that ``wandb sync`` can upload later; it needs no account and no network.
``"online"`` is an explicit opt-in.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from flowlib.infra.progress import say
from flowlib.infra.runs import (
    default_run_name,
    read_metrics,
    run_dir,
    run_kind,
    save_json,
    save_params,
    save_text,
    shown,
)

WANDB_MODES = ("disabled", "offline", "online")


class Tracker:
    """``log(metrics, step)`` appends to ``metrics.jsonl`` (and W&B); ``finish()`` writes ``metrics.csv``.

    ``step`` may start again (notebook 00 logs a curve per target and method); W&B, which drops any row whose
    step goes back, gets it as a field named ``step`` and counts its rows itself.

    With ``resume=True`` an existing ``metrics.jsonl`` is kept and extended (a resumed run), and ``wall_time``
    goes on from its last row: a learning curve against wall time counts the time spent training, not the
    time the run lay stopped.
    """

    def __init__(self, run_path: Path, config: dict[str, Any] | None = None, wandb_mode: str = "disabled",
                 project: str = "flowlib", name: str | None = None, resume: bool = False):
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode must be one of {WANDB_MODES}, got {wandb_mode!r}")
        self.run_path = Path(run_path)
        self.run_path.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.run_path / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        if resume and self.jsonl.exists():  # a resumed run keeps its history
            self.rows = read_metrics(self.run_path)
        else:
            self.jsonl.write_text("")
        self.wandb_run = None
        self._t0 = time.time() - (self.rows[-1].get("wall_time", 0.0) if self.rows else 0.0)
        if wandb_mode != "disabled":
            try:
                import wandb
            except ImportError as err:
                raise ImportError("wandb_mode is not 'disabled' but wandb is not installed: "
                                  "`pip install wandb`, or set wandb_mode='disabled'") from err
            self.wandb_run = wandb.init(project=project, name=name or self.run_path.name, config=config or {},
                                        mode=wandb_mode, dir=str(self.run_path), reinit="finish_previous")
            self.wandb_run.define_metric("*", step_metric="step")  # charts against the run's step

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": int(step), "wall_time": round(time.time() - self._t0, 3),
               **{k: _plain(v) for k, v in metrics.items()}}
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:  # W&B drops rows whose own step goes back: it counts them, ours is a field
            self.wandb_run.log({**metrics, "step": int(step)})

    def rewind(self, step: int) -> None:
        """Forget rows logged after ``step`` (a run resumed from an earlier checkpoint logs them again)."""
        kept = [row for row in self.rows if row["step"] <= step]
        if len(kept) != len(self.rows):
            dropped = self.rows[-1].get("wall_time", 0.0) - (kept[-1].get("wall_time", 0.0) if kept else 0.0)
            self._t0 += dropped                          # the clock goes back with the rows
            self.rows = kept
            self.jsonl.write_text("".join(json.dumps(row) + "\n" for row in kept))

    def summary(self, metrics: dict[str, Any]) -> None:
        """Final numbers of the run, to ``summary.json`` (and the W&B run summary)."""
        save_json(self.run_path / "summary.json", metrics)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(metrics)

    def finish(self) -> None:
        if self.rows:
            keys = list(dict.fromkeys(k for row in self.rows for k in row))
            with (self.run_path / "metrics.csv").open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=keys)
                writer.writeheader()
                writer.writerows(self.rows)
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def start_run(notebook: str, cfg) -> tuple[Path, Tracker]:
    """Begin a notebook's run: torch threads (``cfg.num_threads``, 0 = torch's default) and seed, the
    folder ``outputs/<notebook>/<run_name>/`` with the resolved ``params.yaml``, and its ``Tracker``
    (a resumed run, with ``cfg.resume``, keeps its metrics).

    A run left at ``run_name`` "default" writes to ``default_run_name()``'s folder (``lab`` in the lab; ``cfg`` is
    updated).  The folder keeps the kind of run that made it (``run_kind``); resuming a folder another kind of run
    made says so."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    if cfg.run_name == "default":
        cfg.run_name = default_run_name()
    run_path = run_dir(notebook, cfg.run_name)
    made_by = (run_path / "run_kind").read_text().strip() if (run_path / "run_kind").is_file() else run_kind()
    if made_by != run_kind() and getattr(cfg, "resume", False) and (run_path / "last.pt").is_file():
        say(f"note: {shown(run_path)} was made by a {made_by} run; this {run_kind()} run resumes it "
            "(name another run_name, or set resume: False, to start apart)")
    save_text(run_path / "run_kind", run_kind() + "\n")
    save_params(run_path, cfg)
    tracker = Tracker(run_path, dataclasses.asdict(cfg), wandb_mode=cfg.wandb_mode,
                      project=f"flowlib-{notebook.split('_')[0]}", resume=cfg.resume)
    return run_path, tracker
