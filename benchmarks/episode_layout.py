"""Where on the table PickCube episodes fail: an evaluation's results split by the cube's start and the goal's height.

A diagnostic for stage 3 (docs/stage3.md, "The misses are one half of the table"): ``flowlib.tools.evaluate`` writes, per env
seed, each policy's success and task flags (``outputs/evaluate/<name>/per_episode.csv``, ``per_episode_flags.csv``).
This script resets PickCube-v1 with the same seeds through the same env (``flowlib.envs.maniskill.make_env``, as
``flowlib.policies.bc.evaluate`` does) and reads the layout from the reset observation: the cube's start (x, y) and the
goal's (x, y, z).  Per policy it prints

* grasped and success on the two halves of the table, cube ``y < 0`` / ``y >= 0``;
* per goal-height bin: the episodes that grasp the cube, and the share of those that place it (``is_obj_placed``);

and writes ``outputs/benchmarks/episode_layout/<name>.csv`` (one row per episode and policy: layout, success,
flags) and ``<name>.json`` (the tables).

    .venv/bin/python benchmarks/episode_layout.py cpu150_dense_reach1 cpu150_residual_step
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from flowlib.envs.maniskill import make_env
from flowlib.infra.runs import outputs_root, run_dir, save_json

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark that reads PickCube's layout
from latent_steering import GOAL, OBJ, check_layout  # noqa: E402

GOAL_Z_BINS = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4]  # metres above the table; PickCube draws the goal's z in [0.02, 0.32]


def layouts(seeds: list[int]) -> pd.DataFrame:
    """The cube's start ``cx, cy`` and the goal ``gx, gy, gz`` of PickCube-v1 reset with each env seed."""
    rows = []
    with make_env("PickCube-v1", 1, control_mode="pd_ee_delta_pos") as env:
        for s in tqdm(seeds, desc="layouts"):
            obs = env.reset(seed=[s]).cpu()  # [1, 42]
            check_layout(obs)
            (cx, cy, _), (gx, gy, gz) = obs[0, OBJ].tolist(), obs[0, GOAL].tolist()
            rows.append({"env_seed": s, "cx": cx, "cy": cy, "gx": gx, "gy": gy, "gz": gz})
    return pd.DataFrame(rows)


def episodes(folder: Path) -> pd.DataFrame:
    """One row per (env seed, policy) of an evaluate folder: ``success`` (once) and the flags seen once."""
    for f in ("per_episode.csv", "per_episode_flags.csv"):
        if not (folder / f).exists():
            raise FileNotFoundError(f"{folder / f} is missing: run `python -m flowlib.evaluate ... --run-name "
                                    f"{folder.name}` first (this script reads its per-episode tables)")
    success = pd.read_csv(folder / "per_episode.csv").melt("env_seed", var_name="policy", value_name="success")
    flags = pd.read_csv(folder / "per_episode_flags.csv")
    for need in ("is_grasped", "is_obj_placed"):
        if need not in flags:
            raise ValueError(f"{folder / 'per_episode_flags.csv'} has no {need!r} column: this script reads "
                             f"PickCube-v1 evaluations (flags {list(flags.columns[2:])})")
    return success.merge(flags, on=["env_seed", "policy"], validate="one_to_one")


def tables(d: pd.DataFrame) -> dict:
    """Per policy: grasped / success by table half, and grasped episodes / placed-given-grasped by goal height."""
    out = {}
    for policy, g in d.groupby("policy", sort=False):
        half = g.groupby(np.where(g.cy < 0, "y<0", "y>=0"))
        grasped = g[g.is_grasped.astype(bool)]
        height = grasped.groupby(pd.cut(grasped.gz, GOAL_Z_BINS), observed=False).is_obj_placed
        out[policy] = {
            "episodes": len(g), "success": float(g.success.mean()), "grasped": float(g.is_grasped.mean()),
            "halves": {h: {"episodes": len(x), "grasped": float(x.is_grasped.mean()), "success": float(x.success.mean())}
                       for h, x in half},
            "placed_given_grasped_by_goal_z": {str(b): {"grasped": int(n), "placed": float(m) if n else None}
                                                for (b, m), n in zip(height.mean().items(), height.size())},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("evaluations", nargs="+", help="names of outputs/evaluate/<name>/ folders (PickCube-v1)")
    ap.add_argument("--name", default=None, help="output name (default: the first evaluation's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = pd.concat([episodes(outputs_root() / "evaluate" / e).assign(evaluation=e) for e in args.evaluations])
    d = d.merge(layouts(sorted(d.env_seed.unique().tolist())), on="env_seed")
    d["policy"] = d.evaluation + ":" + d.policy
    out = tables(d)
    for policy, t in out.items():
        halves = " / ".join(f"{t['halves'][h]['grasped']:.3f} / {t['halves'][h]['success']:.3f} ({t['halves'][h]['episodes']})"
                            for h in ("y<0", "y>=0") if h in t["halves"])
        print(f"\n{policy}: success {t['success']:.3f}, grasped {t['grasped']:.3f}; grasped / success at "
              f"y < 0 / y >= 0: {halves}")
        print("  placed given grasped, by goal height (m): " + ", ".join(
            f"{b} {v['placed']:.2f} of {v['grasped']}" for b, v in t["placed_given_grasped_by_goal_z"].items()
            if v["grasped"]))
    name = args.name or args.evaluations[0]
    folder = run_dir("benchmarks", "episode_layout")
    d.to_csv(folder / f"{name}.csv", index=False)
    save_json(folder / f"{name}.json", {"evaluations": args.evaluations, "goal_z_bins": GOAL_Z_BINS, "policies": out})
    print(f"wrote {folder / name}.csv and .json")


if __name__ == "__main__":
    main()
