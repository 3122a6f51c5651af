"""Stage-3 cost per noise method: the policy's share of an env step in rollouts, and PPO re-scoring time.

Prints one row per (method, num_envs): raw simulator ms per env step (random actions), the policy's ms
per env step inside ``reinflow.collect`` (chain sampling, values, bookkeeping), their ratio (issue 5's
target: <= 0.25 on CPU), the env steps/s of the whole rollout loop, the peak memory (GPU memory when the
policy runs on CUDA, else this process's resident memory), and the time to re-score a minibatch of 64
stored chains with gradients (hybrid runs one net call per sample instead of K).  Run it on an otherwise
idle machine:

    .venv/bin/python benchmarks/reinflow_overhead.py --checkpoint 01_shortcut_bc/cpu100/best_model.pt

On a GPU machine the policy runs on the GPU; ``--backend physx_cpu`` keeps the physics in one CPU process
per env (``--num-envs 1 4 16 32``), ``physx_cuda`` runs all envs in one GPU process.
"""
from __future__ import annotations

import argparse
import time

import torch

from flowlib.envs.maniskill import make_env
from flowlib.methods import stage3
from flowlib.tools import bench, pirl


def rescoring_ms(agent, obs_window: torch.Tensor, repeats: int = 5) -> float:
    chain, _, stochastic, _ = agent.sample(obs_window, torch.Generator().manual_seed(0), return_steps=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step_lp, entropy = agent.step_log_probs(obs_window, chain, stochastic)
        (step_lp.sum() + entropy.sum()).backward()
        if obs_window.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="", help="stage-1/2 best_model.pt under outputs/ ('' = 01_shortcut_bc/default)")
    ap.add_argument("--methods", nargs="+", default=["reinflow", "flow_sde", "flow_sde+hybrid"], choices=sorted(pirl.VARIANTS))
    ap.add_argument("--num-envs", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--decisions", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="auto", choices=["auto", "physx_cpu", "physx_cuda"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"policy on {device}")
    print(f"{'method':>16} {'envs':>4} {'raw ms/step':>11} {'policy ms/step':>14} {'overhead':>8} "
          f"{'loop steps/s':>12} {'peak MiB':>8} {'rescore64 ms':>12}")
    for n in args.num_envs:
        with make_env("PickCube-v1", n, backend=args.backend) as env:
            for method in args.methods:
                cfg = stage3.Stage3Config(init_checkpoint=args.checkpoint, num_envs=n, num_inference_steps=args.K,
                                              log_prob_over="executed", **pirl.VARIANTS[method])
                agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
                agent.to(device)
                row = bench.overhead(agent, env, args.decisions)
                obs = torch.randn(64, agent.obs_horizon, agent.obs_dim, device=device)
                print(f"{method:>16} {n:>4} {row['raw_step_ms']:>11.2f} {row['policy_ms_per_env_step']:>14.2f} "
                      f"{row['overhead_fraction']:>8.2f} {row['loop_env_steps_per_s']:>12.0f} "
                      f"{bench.peak_memory_mb():>8.0f} {rescoring_ms(agent, obs):>12.1f}", flush=True)


if __name__ == "__main__":
    main()
