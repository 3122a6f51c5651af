"""The fast tasks on a GPU, as one short job: throughput against num_envs, then time to a success level on FastPush.

A lent GPU session runs this once (#70, item 5); every number it prints comes from the same params files the CPU
runs use, with only the env count, the budget and the device changed:

1. the stage-1 push clone (``params/01_shortcut_bc/fast_push_mlp.yaml``), trained first if ``outputs/`` lacks it;
2. ``benchmarks/fast_env_throughput.py`` on it: raw and policy-in-the-loop env steps/s and peak memory against
   ``--num-envs`` (1k-64k on CUDA);
3. chain ReinFlow on FastPush (``params/03_reinflow/fast_push_mlp.yaml``) at ``--train-envs`` envs, validated every
   ``--eval-every`` iterations, stopped at ``--budget`` env steps; the wall time and env steps at which validation
   first reached ``--level``.

    .venv/bin/python benchmarks/gpu_fast_push.py                          # on the GPU machine (~4 min on an H200)
    .venv/bin/python benchmarks/gpu_fast_push.py --backend torch_cpu --num-envs 256 --train-envs 256 \\
        --budget 409600 --level 0.5 --run-name cpu_check                  # the same path on CPU, in a minute

Writes ``outputs/benchmarks/gpu_fast_push/<run-name>.json``; the stage-3 run is ``outputs/03_reinflow/gpu_fast_push-<run-name>``.
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fast_env_throughput, beside this file
import fast_env_throughput  # noqa: E402

from flowlib.infra.runs import REPO_ROOT, outputs_root, read_metrics, run_dir, save_json  # noqa: E402

STAGE1_PARAMS = "params/01_shortcut_bc/fast_push_mlp.yaml"
STAGE1_CHECKPOINT = "01_shortcut_bc/fast_push_mlp/best_model.pt"
STAGE3_PARAMS = "params/03_reinflow/fast_push_mlp.yaml"


def flowlib_run(*args: str) -> None:
    """``python -m flowlib.run ...`` in a child process; its progress streams here, a failure stops the benchmark."""
    subprocess.run([sys.executable, "-m", "flowlib.run", *args], cwd=REPO_ROOT, check=True)


def time_to_level(rows: list[dict], level: float) -> dict:
    """The first validation row (``eval/success_once``) at or above ``level``: its env steps and wall time."""
    for row in rows:
        if row.get("eval/success_once", -1.0) >= level:
            return {"reached": True, "env_steps": row["step"], "wall_s": row["wall_time"], "iteration": row["iteration"],
                    "success": row["eval/success_once"]}
    evals = [r["eval/success_once"] for r in rows if "eval/success_once" in r]
    return {"reached": False, "best": max(evals) if evals else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=["auto", "torch_cpu", "torch_cuda"])
    ap.add_argument("--num-envs", nargs="+", type=int, default=[1024, 4096, 16384, 65536], help="throughput rows")
    ap.add_argument("--train-envs", type=int, default=4096, help="envs of the stage-3 run")
    ap.add_argument("--budget", type=int, default=16_384_000, help="env steps of the stage-3 run")
    ap.add_argument("--eval-every", type=int, default=5, help="iterations between validations")
    ap.add_argument("--level", type=float, default=0.95, help="validation success whose first time is reported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--run-name", default="default")
    args = ap.parse_args(argv)
    backend = args.backend if args.backend != "auto" else ("torch_cuda" if torch.cuda.is_available() else "torch_cpu")
    device = "GPU " + torch.cuda.get_device_name(0) if backend == "torch_cuda" else platform.processor() or "CPU"
    print(f"== {device}, backend {backend}", flush=True)

    if not (outputs_root() / STAGE1_CHECKPOINT).exists():
        print(f"== stage 1: {STAGE1_PARAMS} (no {STAGE1_CHECKPOINT} yet)", flush=True)
        flowlib_run("01_shortcut_bc", "--params", STAGE1_PARAMS, "-p", f"backend={backend}")

    print("== throughput with the policy in the loop", flush=True)
    throughput = fast_env_throughput.main(["--task", "FastPush-v0", "--checkpoint", STAGE1_CHECKPOINT, "--backend",
                                           backend, "--threads", str(args.threads), "--run-name", args.run_name,
                                           "--num-envs", *map(str, args.num_envs)])

    run_name = f"gpu_fast_push-{args.run_name}"
    print(f"== chain ReinFlow on FastPush, {args.train_envs} envs, {args.budget} env steps: outputs/03_reinflow/{run_name}",
          flush=True)
    t0 = time.time()
    flowlib_run("03_reinflow", "--params", STAGE3_PARAMS, "-p", f"backend={backend}", "-p", f"num_envs={args.train_envs}",
                "-p", f"bench_num_envs=[{args.train_envs}]", "-p", f"total_env_steps={args.budget}",
                "-p", f"eval_every={args.eval_every}", "-p", "resume=false", "--run-name", run_name)
    reached = time_to_level(read_metrics(outputs_root() / "03_reinflow" / run_name), args.level)
    result = {"device": device, "backend": backend, "throughput": throughput, "train_envs": args.train_envs,
              "budget_env_steps": args.budget, "level": args.level, "time_to_level": reached,
              "stage3_wall_s": time.time() - t0, "stage3_run": f"03_reinflow/{run_name}"}
    if reached["reached"]:
        print(f"== validation reached {args.level} at iteration {reached['iteration']}: {reached['env_steps']:,} env "
              f"steps, {reached['wall_s']:.0f} s into training", flush=True)
    else:
        print(f"== validation never reached {args.level} within {args.budget:,} env steps (best {reached['best']})",
              flush=True)
    save_json(run_dir("benchmarks", "gpu_fast_push") / f"{args.run_name}.json", result)
    return result


if __name__ == "__main__":
    main()
