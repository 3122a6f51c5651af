"""The policy's side of a stage-3 env step at GPU batch sizes: how many env steps per second it can serve.

With hundreds of ``physx_cuda`` envs in one process, every decision samples one noisy chain per env in a
single batch.  For each ``--batch`` (the number of envs) and ``--K``, this times, on random observations:

* ``sample``: the noisy chain ``[B, K+1, H, A]`` with its joint log-prob (ReinFlow Eq. 4-5), plus ``V(o)``:
  what ``reinflow.collect`` runs once per decision;
* ``rescore``: PPO's re-scoring of the same ``B`` chains with gradients (``step_log_probs`` + backward), the
  cost of one minibatch of that size in the update;

and reports decisions/s, the env steps/s the policy alone can serve (``B * Ta`` env steps per decision, Ta
actions executed per chunk), and the peak memory (GPU memory on CUDA, else this process's resident memory).
The simulator's own rate is the other half: ManiSkill reports ~127k env steps/s for state PickCube at 1024
envs on an RTX 4090 (``../shared/NOTES.md``); ``benchmarks/reinflow_overhead.py`` measures both halves
together where the physics runs.

    .venv/bin/python benchmarks/policy_throughput.py --checkpoint 01_shortcut_bc/cpu100/best_model.pt \\
        --batch 64 128 256 512 1024 --K 4 8

Prints one row per (K, batch) and writes ``outputs/benchmarks/policy_throughput/<name>.json``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import reinflow_agent, stage3
from flowlib.tools import bench


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_s(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: kernels, allocator, lazy init
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(agent: reinflow_agent.ReinFlowAgent, batch: int, device: torch.device, repeats: int = 5,
            seed: int = 0) -> dict:
    """One row: sample + value and re-score + backward times for ``batch`` observations on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(batch, agent.obs_horizon, agent.obs_dim, generator=gen).to(device)  # [B, To, O]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def sample():
        with torch.no_grad():
            agent.sample(obs, gen)
            agent.value(obs)

    sample_s = _median_s(sample, device, repeats)
    with torch.no_grad():
        chain, _, stochastic, _ = agent.sample(obs, gen, return_steps=True)  # [B, K+1, H, A], [B, K]

    def rescore():
        agent.zero_grad(set_to_none=True)
        step_lp, entropy = agent.step_log_probs(obs, chain, stochastic)
        (step_lp.sum() + entropy.sum()).backward()

    rescore_s = _median_s(rescore, device, repeats)
    return {"batch": batch, "K": agent.K, "sample_ms": 1e3 * sample_s, "decisions_per_s": batch / sample_s,
            "policy_env_steps_per_s": batch * agent.act_horizon / sample_s, "rescore_ms": 1e3 * rescore_s,
            "peak_memory_mb": bench.peak_memory_mb()}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="", help="stage-1/2 best_model.pt under outputs/ ('' = 01_shortcut_bc/default)")
    ap.add_argument("--batch", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
    ap.add_argument("--K", nargs="+", type=int, default=[4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU (the training runs use 1)")
    ap.add_argument("--name", default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {args.threads} thread(s)"
    print(f"policy on {name}")
    print(f"{'K':>2} {'batch':>6} {'sample+V ms':>11} {'decisions/s':>11} {'env steps/s':>11} {'rescore ms':>10} "
          f"{'peak MiB':>8}")
    rows = []
    for K in args.K:
        cfg = stage3.Stage3Config(init_checkpoint=args.checkpoint, num_inference_steps=K, log_prob_over="executed")
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg))
        agent.to(device)
        for b in args.batch:
            row = measure(agent, b, device, args.repeats)
            rows.append(row)
            print(f"{K:>2} {b:>6} {row['sample_ms']:>11.1f} {row['decisions_per_s']:>11.0f} "
                  f"{row['policy_env_steps_per_s']:>11.0f} {row['rescore_ms']:>10.1f} {row['peak_memory_mb']:>8.0f}",
                  flush=True)
    save_json(run_dir("benchmarks", "policy_throughput") / f"{args.name}.json",
              {"checkpoint": args.checkpoint, "device": name, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
