"""What one TD3 step of the per-step residual costs (``flowlib.methods.residual_td3.td3_update``), and Adam's share of it.

The target run (``params/06_steering/cpu.yaml``) takes 0.25 gradient steps per env step, ~78k in all, and on 2
cores they were ~37% of its wall time: at these sizes (batch 256, MLPs 256 x 256) a step is as much per-op overhead
as arithmetic. This builds the agent a params file describes (its start checkpoint, fresh residual and critics:
the cost does not depend on their weights), fills a replay buffer with random transitions, and times ``--updates``
steps (the actor's every ``td3_policy_delay``-th, as after the warm-up) for each Adam implementation in ``--adam``
(``loop``: torch's CPU default, ``foreach``, ``fused``: what ``residual_td3.optimizers`` builds), on all cores as
training runs them.

    .venv/bin/python benchmarks/td3_update_speed.py --params params/06_steering/cpu.yaml --adam loop foreach fused

Prints and writes (``outputs/benchmarks/td3_update_speed/<name>.json``) one row per implementation: ms per step
(median of ``--repeats``, the implementations interleaved), and the whole run's update time at that rate.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from tqdm import tqdm

from flowlib.infra import config
from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import residual_td3, stage3
from flowlib.rl.loop import on_all_cores

ADAM = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def random_replay(agent, size: int, generator: torch.Generator):
    """A replay buffer of ``size`` random transitions (the step's cost does not depend on their values)."""
    buffer = residual_td3.replay_buffer(agent, size)
    obs = (agent.obs_horizon, agent.obs_dim)
    A, b = agent.action_dim, agent.residual_bound
    buffer.add(obs=torch.randn(size, *obs, generator=generator),
               latent=b * (2 * torch.rand(size, A, generator=generator) - 1),  # uniform in the bound
               reward=torch.randn(size, generator=generator), bootstrap=torch.full((size,), 0.8),
               next_obs=torch.randn(size, *obs, generator=generator), base=torch.randn(size, A, generator=generator),
               next_base=torch.randn(size, A, generator=generator))
    return buffer


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/06_steering/cpu.yaml", help="a steer: residual_step params file")
    ap.add_argument("--adam", nargs="+", choices=sorted(ADAM), default=["foreach", "fused"])
    ap.add_argument("--updates", type=int, default=200, help="steps per repeat")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="default")
    args = ap.parse_args(argv)
    cfg = config.from_yaml(stage3.Stage3Config, args.params)
    if cfg.steer != "residual_step":
        raise SystemExit(f"error: {args.params} has steer {cfg.steer!r}; this benchmark times steer: residual_step")
    torch.manual_seed(args.seed)
    agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg))
    agent.train()
    gen = torch.Generator().manual_seed(args.seed)
    buffer = random_replay(agent, 20_000, gen)
    steps_per_run = round(cfg.replay_updates_per_decision * cfg.total_env_steps)
    opts = {name: (torch.optim.Adam(agent.policy_parameters(), lr=cfg.actor_lr, **ADAM[name]),
                   torch.optim.Adam(agent.value_parameters(), lr=cfg.critic_lr, **ADAM[name])) for name in args.adam}

    def steps(name: str, n: int) -> float:
        """Seconds per step over ``n`` steps with ``name``'s optimisers."""
        actor_opt, critic_opt = opts[name]
        t = time.perf_counter()
        on_all_cores(lambda i: residual_td3.td3_update(agent, buffer.sample(cfg.replay_batch_size, gen), actor_opt,
                                                        critic_opt, cfg, train_policy=(i + 1) % cfg.td3_policy_delay == 0), n)
        return (time.perf_counter() - t) / n

    for name in args.adam:
        steps(name, 20)  # warm the allocator and the optimiser's state
    times = {name: [] for name in args.adam}
    for _ in tqdm(range(args.repeats), desc="repeats"):  # interleaved, so that a busy spell of the host hits all alike
        for name in args.adam:
            times[name].append(steps(name, args.updates))
    rows = []
    for name in args.adam:
        ms = 1e3 * statistics.median(times[name])
        spread = 1e3 * (max(times[name]) - min(times[name]))
        rows.append({"adam": name, "ms_per_step": round(ms, 2), "ms_spread": round(spread, 2),
                     "steps_per_run": steps_per_run, "run_update_min": round(ms * steps_per_run / 6e4, 1),
                     "threads": os.cpu_count(), "batch": cfg.replay_batch_size})
        print(f"adam {name:8s} {ms:6.2f} ms per step (max - min over repeats {rows[-1]['ms_spread']:.2f}) -> "
              f"{rows[-1]['run_update_min']:5.1f} min for the run's {steps_per_run:,} steps")
    save_json(run_dir("benchmarks", "td3_update_speed") / f"{args.name}.json", {"params": args.params, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
