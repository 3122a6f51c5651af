"""Where one ManiSkill env step goes on CPU: physics against ManiSkill's own per-step code.

On 2 cores the target run (``params/06_steering/cpu.yaml``) spends about two thirds of its wall time in rollouts,
and the policy's share of those is small (``reinflow_overhead.py``): the simulator step is the cost. This steps
one ``physx_cpu`` env in this process (``flowlib.envs.maniskill.make_env``, as a rollout worker runs it) with seeded random
actions and times the parts of ManiSkill's ``step``:

    controller   ``agent.set_action``: the controller's targets (for ``pd_ee_delta_pos``: the end effector's
                 pose in the robot's base frame, then inverse kinematics)
    physics      ``scene.step``, ``sim_freq / control_freq`` times (PhysX; 5 substeps for PickCube)
    evaluate     ``get_info``: the task's success / grasp / placement flags
    observation  ``get_obs``: the state vector
    reward       ``get_reward``
    other        the rest of the step: gymnasium's and ManiSkill's wrappers, numpy / torch conversions

    .venv/bin/python benchmarks/sim_step_profile.py --steps 500 --repeats 5

Prints and writes (``outputs/benchmarks/sim_step_profile/<name>.json``) one row per part: ms per env step, its
share of the whole step and its calls per step, from the repeat with the median step time (so that the parts add
up).  Run it on an otherwise idle machine; a busy host moves every row.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from tqdm import tqdm

from flowlib.envs.maniskill import make_env
from flowlib.envs.tasks import DEFAULT_CONTROL_MODE
from flowlib.infra.runs import run_dir, save_json

PARTS = ("controller", "physics", "evaluate", "observation", "reward")


def timed(fn, totals: dict, part: str):
    """``fn`` that adds its wall time to ``totals[part]`` and one to ``totals[part + " calls"]`` at each call."""
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] += time.perf_counter() - t
            totals[part + " calls"] += 1
    return wrapper


def instrument(base, totals: dict) -> None:
    """Time the parts of ManiSkill's ``BaseEnv.step`` on the unwrapped env ``base`` (instance attributes shadow
    the methods that ``step`` looks up on ``self``)."""
    base.agent.set_action = timed(base.agent.set_action, totals, "controller")
    base.scene.step = timed(base.scene.step, totals, "physics")
    base.get_info = timed(base.get_info, totals, "evaluate")
    base.get_obs = timed(base.get_obs, totals, "observation")
    base.get_reward = timed(base.get_reward, totals, "reward")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env-id", default="PickCube-v1")
    ap.add_argument("--control-mode", default=DEFAULT_CONTROL_MODE)
    ap.add_argument("--steps", type=int, default=500, help="timed env steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="default")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        raise SystemExit(f"error: --steps and --repeats must be >= 1, got {args.steps} and {args.repeats}")
    torch.set_num_threads(1)  # as in a rollout worker
    with make_env(args.env_id, 1, control_mode=args.control_mode, backend="physx_cpu") as env:
        totals: dict[str, float] = defaultdict(float)
        instrument(env.env.envs[0].unwrapped, totals)
        gen = torch.Generator().manual_seed(args.seed)
        per_repeat = defaultdict(list)  # part -> seconds (part + " calls" -> calls) per env step, one per repeat
        episode = 0
        for _ in tqdm(range(args.repeats), desc="repeats"):
            totals.clear()
            step_s, done = 0.0, 0
            while done < args.steps:
                kept = dict(totals)
                env.reset(seed=args.seed + episode)  # untimed: what it calls is not counted either
                totals.clear()
                totals.update(kept)
                episode += 1
                for _ in range(min(env.max_episode_steps, args.steps - done)):
                    action = 2 * torch.rand(1, env.spec.action_dim, generator=gen) - 1  # [1, A]
                    t = time.perf_counter()
                    env.step(action)
                    step_s += time.perf_counter() - t
                    done += 1
            per_repeat["step"].append(step_s / done)
            for part in PARTS:
                per_repeat[part].append(totals[part] / done)
                per_repeat[part + " calls"].append(totals[part + " calls"] / done)
            per_repeat["other"].append((step_s - sum(totals[p] for p in PARTS)) / done)
    # the median repeat by step time, whole, so that its parts add up to its step
    median = sorted(range(args.repeats), key=per_repeat["step"].__getitem__)[args.repeats // 2]
    step_ms = 1e3 * per_repeat["step"][median]
    rows = []
    for part in (*PARTS, "other", "step"):
        ms = 1e3 * per_repeat[part][median]
        calls = per_repeat[part + " calls"][median] if part in PARTS else 1
        rows.append({"part": part, "ms_per_step": round(ms, 3), "share": round(ms / step_ms, 3),
                     "calls_per_step": calls})
        print(f"{part:12s} {ms:7.3f} ms per env step  {100 * ms / step_ms:5.1f}%  ({calls:g} calls)")
    print(f"one process: {1e3 / step_ms:.0f} env steps/s ({args.env_id}, {args.control_mode}, physx_cpu)")
    save_json(run_dir("benchmarks", "sim_step_profile") / f"{args.name}.json",
              {"env_id": args.env_id, "control_mode": args.control_mode, "steps": args.steps,
               "repeats": args.repeats, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
