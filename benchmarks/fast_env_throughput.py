"""Throughput of a fast torch task (``flowlib.envs.fast_envs``) with the policy in the loop, against num_envs.

One row per num_envs: the raw env's steps/s (random actions), the steps/s of chain ReinFlow's whole rollout loop
(``reinflow.collect``: one noisy chain and V per decision for all envs, ``Ta`` env steps per decision, bookkeeping),
the policy's share of that loop, and the peak memory (GPU memory when the policy runs on CUDA, else this process's
resident memory).  The target of issue 70: >= 100k env steps/s on 2 CPU cores at >= 1024 envs, policy included.

    .venv/bin/python benchmarks/fast_env_throughput.py --task FastPush-v0 \\
        --checkpoint 01_shortcut_bc/fast_push/best_model.pt --num-envs 256 1024 4096

On a GPU machine the envs and the policy run on CUDA (``--backend torch_cuda``); add 16384 65536 to the list.
Writes ``outputs/benchmarks/fast_env_throughput/<run-name>.json``.
"""
from __future__ import annotations

import argparse
import platform

import torch

from flowlib.envs.maniskill import make_env
from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import stage3
from flowlib.tools import bench


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="FastPush-v0", choices=["FastReach-v0", "FastPush-v0"])
    ap.add_argument("--checkpoint", required=True, help="a stage-1 best_model.pt of --task, under outputs/")
    ap.add_argument("--num-envs", nargs="+", type=int, default=[256, 1024, 4096])
    ap.add_argument("--K", type=int, default=4, help="denoising steps of the chain")
    ap.add_argument("--decisions", type=int, default=8, help="chunk decisions timed per row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="auto", choices=["auto", "torch_cpu", "torch_cuda"])
    ap.add_argument("--run-name", default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'envs':>6} {'raw steps/s':>12} {'loop steps/s':>12} {'policy share':>12} {'peak MiB':>9}")
    for n in args.num_envs:
        with make_env(args.task, n, backend=args.backend) as env:
            cfg = stage3.Stage3Config(init_checkpoint=args.checkpoint, env_id=args.task, num_envs=n,
                                      num_inference_steps=args.K)
            agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
            agent.to(env.device)
            bench.overhead(agent, env, 1)  # untimed: CUDA's first launches (and caches) would count in the first row
            row = bench.overhead(agent, env, args.decisions)
            loop_policy = row["policy_ms_per_env_step"] / (1e3 / row["loop_env_steps_per_s"])
            rows.append({"task": args.task, "num_envs": n, "raw_env_steps_per_s": 1e3 / row["raw_step_ms"],
                         "loop_env_steps_per_s": row["loop_env_steps_per_s"], "policy_share_of_loop": loop_policy,
                         "peak_memory_mb": bench.peak_memory_mb(), "K": args.K, "device": str(env.device)})
            print(f"{n:>6} {rows[-1]['raw_env_steps_per_s']:>12.0f} {row['loop_env_steps_per_s']:>12.0f} "
                  f"{loop_policy:>12.2f} {rows[-1]['peak_memory_mb']:>9.0f}", flush=True)
    save_json(run_dir("benchmarks", "fast_env_throughput") / f"{args.run_name}.json",
              {"threads": args.threads, "machine": platform.processor() or platform.machine(), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
