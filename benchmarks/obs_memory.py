"""The seed's memory table: peak memory and env steps/s against ``num_envs``, per observation mode.

For each ``--obs-modes`` (state, rgb, rgbd, pointcloud) and ``--num-envs``, this makes ``flowlib.envs.maniskill.make_env``'s
envs of ``--env-id`` (``physx_cpu``: one process per env behind gymnasium's AsyncVectorEnv; ``physx_cuda`` with all
envs in one process where SAPIEN's GPU PhysX loads), resets them, steps them ``--steps`` times with random actions,
and reports:

* ``env_steps_per_s``: env steps per second of the whole batch (the simulator and the renderer; no policy);
* ``peak_rss_mb``: the peak resident memory of this process and its env workers together, sampled every 10 steps
  (``psutil``); ``per_env_mb`` that over ``num_envs``;
* ``obs_kb``: one packed observation frame as the policy reads it (float32), and ``stored_kb``: the same frame as a
  dataset stores it (``flowlib.envs.visual``: uint8 colour, float16 depth and points, float32 state);
* ``peak_gpu_mb``: on a CUDA machine, ``torch.cuda.max_memory_allocated`` (the envs' tensors on ``physx_cuda``).

    .venv/bin/python benchmarks/obs_memory.py --num-envs 1 2 4 --obs-modes state rgb rgbd pointcloud

Prints one row per (mode, num_envs) and writes ``outputs/benchmarks/obs_memory/<name>.csv`` and ``.md`` (the table
in docs/results/visual.md is this script's).  The camera is ``--camera-size`` pixels square (64 by default; ManiSkill
renders PickCube's at 128).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import psutil
import torch

from flowlib.envs import visual
from flowlib.envs.maniskill import make_env
from flowlib.infra.runs import run_dir, save_text


def tree_rss_mb() -> float:
    """Resident memory of this process and all its children, in MiB."""
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def stored_kb(mode: str, obs_dim: int, camera_size: int, num_points: int) -> float:
    """One frame as ``flowlib.envs.visual``'s demo files store it: float32 state, uint8 colour, float16 depth and points."""
    if mode == "state":
        return 4 * obs_dim / 1024
    view = _view_dim(mode, camera_size, num_points)
    pixels = camera_size * camera_size
    stored = {"rgb": 3 * pixels, "rgbd": 3 * pixels + 2 * pixels, "pointcloud": 2 * view}[mode]
    return (4 * (obs_dim - view) + stored) / 1024


def measure(env_id: str, mode: str, num_envs: int, steps: int, camera_size: int, num_points: int,
            backend: str) -> dict:
    kwargs = {} if mode == "state" else {"obs_mode": mode, "camera_size": camera_size, "num_points": num_points}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    peak = tree_rss_mb()
    with make_env(env_id, num_envs, backend=backend, max_episode_steps=steps + 1, **kwargs) as env:
        obs = env.reset(seed=0)
        peak = max(peak, tree_rss_mb())
        t0 = time.time()
        for i in range(steps):
            obs = env.step(torch.rand(num_envs, env.spec.action_dim, device=env.device) * 2 - 1)[0]
            if i % 10 == 0:
                peak = max(peak, tree_rss_mb())
        rate = steps * num_envs / (time.time() - t0)
        row = {"obs_mode": mode, "num_envs": num_envs, "backend": env.backend, "env_steps_per_s": rate,
               "peak_rss_mb": peak, "per_env_mb": peak / num_envs, "obs_kb": 4 * obs.shape[-1] / 1024,
               "stored_kb": stored_kb(mode, obs.shape[-1], camera_size, num_points)}
    if torch.cuda.is_available():
        row["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return row


def _view_shape(mode: str, camera_size: int, num_points: int) -> tuple[int, ...]:
    return {"rgb": (camera_size, camera_size, 3), "rgbd": (camera_size, camera_size, 4),
            "pointcloud": (num_points, 3)}[mode]


def _view_dim(mode: str, camera_size: int, num_points: int) -> int:
    return int(np.prod(_view_shape(mode, camera_size, num_points)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="PickCube-v1")
    parser.add_argument("--obs-modes", nargs="+", default=["state", "rgb", "rgbd", "pointcloud"],
                        choices=visual.OBS_MODES)
    parser.add_argument("--num-envs", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=100, help="env steps per measurement (after the reset)")
    parser.add_argument("--camera-size", type=int, default=64)
    parser.add_argument("--num-points", type=int, default=512)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--name", default="cpu")
    args = parser.parse_args()
    rows = []
    for mode in args.obs_modes:
        for n in args.num_envs:
            row = measure(args.env_id, mode, n, args.steps, args.camera_size, args.num_points, args.backend)
            rows.append(row)
            print(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    table = pd.DataFrame(rows)
    out = run_dir("benchmarks", "obs_memory") / args.name
    table.to_csv(out.with_suffix(".csv"), index=False)
    save_text(out.with_suffix(".md"), table.round(1).to_markdown(index=False) + "\n")
    print(f"wrote {out}.csv / .md")


if __name__ == "__main__":
    main()
