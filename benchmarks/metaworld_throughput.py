"""Env steps/s of Meta-World (MuJoCo) and ManiSkill (``physx_cpu``) side by side, at 1 / 2 / 4 envs, in one run,
and the chain policy's overhead in the loop.

Each simulator is stepped with random actions (the raw rate: the worker processes and their IPC included, new episodes
at the time limit not timed), then, given a stage-1 checkpoint of the Meta-World task, chain ReinFlow's whole rollout
loop runs on it (``flowlib.tools.bench.overhead``: a noisy K-step chain and V per decision, ``Ta`` env steps per decision).
Issue 98's claim to check: Meta-World steps ~4.7x faster than ManiSkill's PickCube on this machine.

    .venv/bin/python benchmarks/metaworld_throughput.py \\
        --checkpoint 01_shortcut_bc/metaworld_pick_place/best_model.pt

Time it on an idle machine (notes: a busy core slows torch's threads many times).  Writes
``outputs/benchmarks/metaworld_throughput/<run-name>.json``.
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from flowlib.envs.maniskill import make_env
from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import stage3
from flowlib.tools import bench


def raw_rate(env_id: str, num_envs: int, steps: int, seed: int = 0) -> float:
    """Env steps/s of ``num_envs`` envs of ``env_id`` under random actions (``steps`` per env; resets untimed)."""
    with make_env(env_id, num_envs) as env:
        env.reset(seed=seed)
        env.step(torch.zeros(num_envs, env.spec.action_dim))  # untimed: the workers' first step
        timed = 0.0
        for i in range(steps):
            action = torch.rand(num_envs, env.spec.action_dim) * 2 - 1
            t0 = time.perf_counter()
            _, _, term, trunc, _ = env.step(action)
            timed += time.perf_counter() - t0
            if (term | trunc).any():
                env.reset(seed=seed + 1000 * (i + 1))
    return steps * num_envs / timed


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metaworld-task", default="pick-place-v3")
    ap.add_argument("--maniskill-task", default="PickCube-v1")
    ap.add_argument("--num-envs", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=600, help="timed steps per env and row")
    ap.add_argument("--checkpoint", default="", help="a stage-1 best_model.pt of --metaworld-task, under outputs/: "
                                                     "also time the chain policy in the loop")
    ap.add_argument("--K", type=int, default=4, help="denoising steps of the chain")
    ap.add_argument("--decisions", type=int, default=40, help="chunk decisions timed per policy row")
    ap.add_argument("--run-name", default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"{'envs':>5} {args.metaworld_task + ' steps/s':>26} {args.maniskill_task + ' steps/s':>26} {'ratio':>6}")
    for n in args.num_envs:
        mw, ms = raw_rate(args.metaworld_task, n, args.steps), raw_rate(args.maniskill_task, n, args.steps // 3)
        rows.append({"num_envs": n, "metaworld_env_steps_per_s": mw, "maniskill_env_steps_per_s": ms, "ratio": mw / ms})
        print(f"{n:>5} {mw:>26.0f} {ms:>26.0f} {mw / ms:>6.1f}", flush=True)
    policy_rows = []
    if args.checkpoint:
        print(f"\nchain policy in the loop on {args.metaworld_task}, K = {args.K}")
        print(f"{'envs':>5} {'raw ms/step':>12} {'policy ms/step':>15} {'loop steps/s':>13}")
        for n in args.num_envs:
            with make_env(args.metaworld_task, n) as env:
                cfg = stage3.Stage3Config(init_checkpoint=args.checkpoint, env_id=args.metaworld_task, num_envs=n,
                                          num_inference_steps=args.K)
                agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
                row = bench.overhead(agent, env, args.decisions)
            policy_rows.append({**row, "K": args.K})
            print(f"{n:>5} {row['raw_step_ms']:>12.3f} {row['policy_ms_per_env_step']:>15.3f} "
                  f"{row['loop_env_steps_per_s']:>13.0f}", flush=True)
    save_json(run_dir("benchmarks", "metaworld_throughput") / f"{args.run_name}.json",
              {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "metaworld_task": args.metaworld_task, "maniskill_task": args.maniskill_task, "rows": rows,
               "policy_rows": policy_rows})
    return rows


if __name__ == "__main__":
    main()
