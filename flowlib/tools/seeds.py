"""A result over seeds: each seed's line and the spread, from ``python -m flowlib.evaluate`` folders.

    python -m flowlib.seeds cpu_s11 cpu_s12 cpu_s13 --policy last.pt --target 0.9 --name cpu_target

Each argument is an evaluation folder (a path, or a name under ``outputs/evaluate/``): its first checkpoint is the
start, the reference of its paired differences, and every other checkpoint whose file is ``--policy`` (all of them
without it) is one seed.  A folder may hold several seeds of one start (``flowlib.tools.evaluate START s0/last.pt
s1/last.pt ...``) or one; seeds from different starts come from different folders.  Per seed: success_once with its
SE, the paired gain over its own start, success at the end and the task's flags.  Over the seeds: the mean, the
std (ddof 1), the range, how many reach ``--target``; and the pooled rate of all seeds x episodes with an SE
clustered by env seed (``flowlib.infra.metrics.clustered_mean``): seeds scored on the same episodes share their hard
ones, and a binomial SE over seeds x episodes would treat them as new.  Writes ``seeds.csv`` and
``summary.json`` under ``outputs/seeds/<name>/``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from flowlib.infra.metrics import clustered_mean
from flowlib.infra.runs import outputs_root, run_dir, save_json, save_text

HOW_TO_MAKE = ("make one with python -m flowlib.evaluate START.pt RUN/last.pt ... --episodes 200 --seed 30000 "
               "--run-name NAME")


def evaluation_folder(arg: str | Path) -> Path:
    """``arg`` as a folder of ``flowlib.tools.evaluate`` (``summary.json`` and ``per_episode.csv``): a path, or a name under
    ``outputs/evaluate/``."""
    for path in (Path(arg), outputs_root() / "evaluate" / str(arg)):
        if (path / "summary.json").is_file() and (path / "per_episode.csv").is_file():
            return path
    raise FileNotFoundError(f"{arg} is not an evaluation folder (no summary.json and per_episode.csv there or under "
                            f"{outputs_root() / 'evaluate'}): {HOW_TO_MAKE}")


def seed_results(folders: list[str | Path], policy: str = "") -> list[dict]:
    """One dict per seed: its ``flowlib.tools.evaluate`` row (``success``, ``se``, ``diff``, ``diff_se``, flags ...), the
    ``start`` and its ``start_success``, the ``evaluation`` folder, and ``per_episode`` (a Series of 0/1 success
    indexed by env seed)."""
    seeds, seen = [], {}
    for arg in folders:
        folder = evaluation_folder(arg)
        rows = json.loads((folder / "summary.json").read_text())["rows"]
        per_episode = pd.read_csv(folder / "per_episode.csv").set_index("env_seed")
        start, chosen = rows[0], [r for r in rows[1:] if not policy or r["policy"].split("/", 1)[-1] == policy]
        if not chosen:
            raise ValueError(f"{folder} has no checkpoint {policy!r} after its start (it has "
                             f"{[r['policy'] for r in rows]}): pass --policy with one of their file names")
        for row in chosen:
            if row["policy"] in seen:
                raise ValueError(f"{row['policy']} is in both {seen[row['policy']]} and {folder}: pass each seed once")
            seen[row["policy"]] = folder
            seeds.append({**row, "evaluation": folder.name, "start": start["policy"],
                          "start_success": start["success"], "per_episode": per_episode[row["policy"]]})
    return seeds


def over_seeds(seeds: list[dict], target: float | None = None) -> dict:
    """The spread over seeds (mean, std with ddof 1, range, the mean paired gain) and the pooled rate of all seeds x
    episodes, its SE clustered by env seed."""
    if len(seeds) < 2:
        raise ValueError(f"a spread over seeds needs at least 2 seeds, got {len(seeds)}")
    success = np.array([s["success"] for s in seeds])
    gain = np.array([s["diff"] for s in seeds])
    outcomes = pd.concat([s["per_episode"] for s in seeds])  # [sum of episodes], indexed by env seed
    pooled, pooled_se = clustered_mean(outcomes.to_numpy(), outcomes.index.to_numpy())
    summary = {"seeds": len(seeds), "mean": float(success.mean()), "std": float(success.std(ddof=1)),
               "min": float(success.min()), "max": float(success.max()),
               "gain_mean": float(gain.mean()), "gain_std": float(gain.std(ddof=1)),
               "starts": {s["start"] + " in " + s["evaluation"]: s["start_success"] for s in seeds},
               "pooled_successes": int(outcomes.sum()), "pooled_episodes": int(len(outcomes)),
               "pooled": pooled, "pooled_se_clustered": pooled_se,
               "pooled_se_binomial": float(np.sqrt(pooled * (1 - pooled) / len(outcomes)))}
    if target is not None:
        summary.update({"target": target, "at_or_above_target": int((success >= target).sum())})
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowlib.seeds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("evaluations", nargs="+", help="flowlib.tools.evaluate folders (paths or names under outputs/evaluate/)")
    ap.add_argument("--policy", default="",
                    help="the seeds' checkpoint file, e.g. last.pt (default: every one after the start)")
    ap.add_argument("--target", type=float, default=None, help="count the seeds whose success_once reaches this")
    ap.add_argument("--name", default="default", help="folder under outputs/seeds/")
    args = ap.parse_args(argv)
    try:
        seeds = seed_results(args.evaluations, args.policy)
        summary = over_seeds(seeds, args.target)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    flags = [k for k in seeds[0] if k.endswith("_once")]
    table = pd.DataFrame([{k: v for k, v in s.items() if k != "per_episode"} for s in seeds])
    table = table[["policy", "evaluation", "start", "start_success", "episodes", "success", "se", "diff", "diff_se",
                   "success_at_end", *flags]]
    run_path = run_dir("seeds", args.name)
    save_text(run_path / "seeds.csv", table.to_csv(index=False))
    save_json(run_path / "summary.json", summary)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    s = summary
    print(f"\n{s['seeds']} seeds: success_once mean {s['mean']:.3f} (std {s['std']:.3f}, {s['min']:.3f}-{s['max']:.3f})"
          f", paired gain over the start {s['gain_mean']:+.3f} (std {s['gain_std']:.3f})"
          + (f"; {s['at_or_above_target']} of {s['seeds']} >= {s['target']}" if "target" in s else ""))
    print(f"pooled {s['pooled_successes']} / {s['pooled_episodes']} = {s['pooled']:.3f} +- "
          f"{s['pooled_se_clustered']:.3f} (clustered by env seed; binomial +- {s['pooled_se_binomial']:.3f})")
    print(f"-> {run_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
