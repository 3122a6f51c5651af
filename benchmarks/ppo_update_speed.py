"""What one PPO minibatch step costs, whole or in micro-batches (``micro_batch_size``, gradient accumulation).

A minibatch of ``--rows`` chain decisions goes through ``ppo.ppo_update`` once (1 epoch, one minibatch, so
one policy step and one value step), for each ``--micro`` slice size (0: the whole minibatch in one pass).
The agent is a real checkpoint's, its chains are sampled by it (so every ratio starts at 1), and its
observations, advantages and returns are random: the cost does not depend on them. Every setting starts
from the same weights and takes the same step (``tests/test_ppo.py`` checks that accumulation is exact).

    .venv/bin/python benchmarks/ppo_update_speed.py outputs/03_reinflow/fb_sgd_s0/last.pt --rows 4096 \\
        --micro 0 256 512 1024 2048

Prints and writes (``outputs/benchmarks/ppo_update_speed/<name>.json``) one row per slice size: seconds per
minibatch step (median of ``--repeats``), ms per row, and on CUDA the peak memory.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import stage3
from flowlib.rl import ppo


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a ReinFlow last.pt / best_model.pt")
    ap.add_argument("--rows", type=int, default=4096, help="chain decisions in the minibatch")
    ap.add_argument("--micro", type=int, nargs="+", default=[0, 512], help="micro_batch_size values (0: one pass)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the training runs use 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, cfg, agent, _ = stage3.load_for_rollouts(args.checkpoint)
    agent = agent.to(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    obs = torch.randn(args.rows, agent.obs_horizon, agent.obs_dim, generator=gen).to(args.device)  # [n, To, O]
    with torch.no_grad():
        # the agent draws its noise on the CPU (as in training) and moves it to its device
        chains, log_probs, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(args.seed),
                                                               return_steps=True)
    batch = {"obs": obs, "chains": chains, "log_probs": log_probs, "stochastic": stochastic,
             "step_log_probs": step_lp, "values": torch.zeros(args.rows, device=args.device),
             "advantages": torch.randn(args.rows, generator=gen).to(args.device),
             "returns": torch.randn(args.rows, generator=gen).to(args.device)}
    rows = []
    for micro in args.micro:
        step_cfg = stage3.Stage3Config(minibatch_size=args.rows, micro_batch_size=micro, update_epochs=1,
                                           ratio_mode=cfg.ratio_mode, clip_coef=cfg.clip_coef)
        times = []
        for _ in range(args.repeats):
            a = copy.deepcopy(agent)
            opt_a = torch.optim.SGD(a.policy_parameters(), cfg.actor_lr)
            opt_c = torch.optim.SGD(a.value_parameters(), cfg.critic_lr)
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
            t = time.perf_counter()
            ppo.ppo_update(a, batch, opt_a, opt_c, step_cfg)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        s = statistics.median(times)
        row = {"rows": args.rows, "micro_batch_size": micro, "s_per_step": s, "ms_per_row": 1e3 * s / args.rows,
               "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else None}
        rows.append(row)
        print(f"micro {micro or args.rows:>6}: {s:7.2f} s per step, {row['ms_per_row']:.2f} ms per row"
              + (f", peak {row['peak_gpu_mib']:.0f} MiB" if row["peak_gpu_mib"] is not None else ""), flush=True)
    save_json(run_dir("benchmarks", "ppo_update_speed") / f"{args.name}.json",
              {"checkpoint": args.checkpoint, "device": args.device, "threads": args.threads, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
