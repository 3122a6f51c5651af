"""Verdicts of a one-knob-at-a-time sweep: each setting's effect against the baseline, paired on held-out episodes and
averaged over training seeds (the rule of ``docs/results/toolkit.md``, written before its runs).

The sweep's checkpoints are scored together by ``flowlib.evaluate`` on the same episodes, so for setting ``r`` and
training seed ``s`` the per-episode difference from the baseline's seed ``s`` is paired (same episodes, same seed):

    d_{r,s} = mean_i [ success_i(r, s) - success_i(baseline, s) ],      se_{r,s} = std_i(...) / sqrt(n)
    effect_r = mean_s d_{r,s},      SE_r = max( std_s(d_{r,s}) / sqrt(S),  sqrt(sum_s se_{r,s}^2) / S )

The first term of ``SE_r`` is the spread between training seeds, the second the episodes' noise (a floor when three
seeds happen to agree).  ``helps``: ``effect > 2 SE``; ``hurts``: ``effect < -2 SE``; otherwise ``no effect``; a row
with fewer than ``min_seeds`` seeds is ``provisional``.  ``success_at_end`` (from ``results.csv``) is compared the same
way, with the binomial SE of two independent rates as the episodes' floor.

Columns are matched by ``<row>_seed<s>/<checkpoint>`` (the sweep's job folders, ``flowlib.tools.sweep``), e.g.
``toolkit/dual_clip_3_seed1/last.pt``; a ``@K4``-style suffix is kept in the row's name.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from flowlib.infra.metrics import paired_means

JOB = re.compile(r"(?:^|/)(?P<row>[^/]+)_seed(?P<seed>\d+)/[^/@]+(?P<suffix>@\S+)?$")


def parse(label: str) -> tuple[str, int] | None:
    """``(row, seed)`` of a policy label such as ``toolkit/adv_mc_seed2/last.pt``; ``None`` when it is no sweep job's."""
    m = JOB.search(label)
    return None if m is None else (m["row"] + (m["suffix"] or ""), int(m["seed"]))


def verdict(effect: float, se: float, seeds: int, min_seeds: int = 3) -> str:
    if seeds < min_seeds:
        return f"provisional ({seeds} seed{'s' if seeds != 1 else ''})"
    return "helps" if effect > 2 * se else "hurts" if effect < -2 * se else "no effect"


def effects(record: str | Path, baseline: str = "baseline", min_seeds: int = 3) -> pd.DataFrame:
    """One row per setting of the evaluated sweep in ``record`` (a folder with ``per_episode.csv`` and
    ``results.csv``, as ``flowlib.evaluate`` and ``flowlib.results publish`` write them): its seeds, its success and
    ``success_at_end`` (means over seeds), the paired effect on success with its SE and verdict, and the effect on
    ``success_at_end``.  The baseline's row comes first, its effects 0."""
    record = Path(record)
    per_episode = pd.read_csv(record / "per_episode.csv")
    summary = pd.read_csv(record / "results.csv").set_index("policy")
    jobs: dict[str, dict[int, str]] = {}
    for col in per_episode.columns:
        parsed = parse(col) if col != "env_seed" else None
        if parsed is not None:
            jobs.setdefault(parsed[0], {})[parsed[1]] = col
    if baseline not in jobs:
        raise ValueError(f"no {baseline!r} row among the sweep's policies of {record} ({sorted(jobs)}): evaluate the "
                         "baseline's checkpoints with the others")
    n = len(per_episode)
    base = jobs[baseline]
    rows = []
    for row in [baseline, *sorted(set(jobs) - {baseline})]:
        seeds = sorted(set(jobs[row]) & set(base))
        if not seeds:
            continue
        d, se, end_d, end_se = [], [], [], []
        for s in seeds:
            _, paired = paired_means({"ref": per_episode[base[s]].tolist(), "row": per_episode[jobs[row][s]].tolist()})
            d.append(paired["diff"])
            se.append(paired["diff_se"])
            p, q = summary.loc[jobs[row][s], "success_at_end"], summary.loc[base[s], "success_at_end"]
            end_d.append(p - q)
            end_se.append(np.sqrt((p * (1 - p) + q * (1 - q)) / n))
        S = len(seeds)
        spread = lambda x: float(np.std(x, ddof=1) / np.sqrt(S)) if S > 1 else 0.0
        effect, err = float(np.mean(d)), max(spread(d), float(np.sqrt(np.sum(np.square(se))) / S))
        end_effect, end_err = float(np.mean(end_d)), max(spread(end_d), float(np.sqrt(np.sum(np.square(end_se))) / S))
        rows.append({"setting": row, "seeds": S,
                     "success_once": float(np.mean([summary.loc[jobs[row][s], "success"] for s in seeds])),
                     "effect": effect, "effect_se": err,
                     "verdict": "(reference)" if row == baseline else verdict(effect, err, S, min_seeds),
                     "success_at_end": float(np.mean([summary.loc[jobs[row][s], "success_at_end"] for s in seeds])),
                     "end_effect": end_effect, "end_effect_se": end_err,
                     "end_verdict": "(reference)" if row == baseline else verdict(end_effect, end_err, S, min_seeds)})
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame) -> str:
    """``effects``' table as the results pages print it (3 decimals, ``+-`` one SE)."""
    lines = ["| setting | seeds | success_once | effect on success_once | verdict | success_at_end | "
             "effect on success_at_end |", "|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        ref = r.verdict == "(reference)"
        eff = "(reference)" if ref else f"{r.effect:+.3f} +- {r.effect_se:.3f}"
        end = "(reference)" if ref else f"{r.end_effect:+.3f} +- {r.end_effect_se:.3f}: {r.end_verdict}"
        lines.append(f"| `{r.setting}` | {r.seeds} | {r.success_once:.3f} | {eff} | {'' if ref else r.verdict} | "
                     f"{r.success_at_end:.3f} | {end} |")
    return "\n".join(lines) + "\n"
