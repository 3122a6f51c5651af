"""Where PickCube episodes go wrong: the gripper's offset from the cube when it closes (episodes that never grasp),
and how the carry ends (episodes that grasp and never place the cube: slipped, dropped, or held off the goal).

A diagnostic for stage 3 (docs/stage3.md, "The dense reward holds the success; neither reward moves the grasp"): the
per-step residual lifts the carry but leaves the grasp rate where stage 1 had it.  Each checkpoint (stage-1/2
``best_model.pt`` or a stage-3 ``last.pt``) runs the same episodes (``--seed``..) through ``flowlib.policies.bc.evaluate``
with the rollouts recorded; for every episode it reads, from the state observations and the executed actions:

* whether the cube was ever grasped (the env's ``is_grasped`` flag) and at which step first;
* the step the gripper first closes (executed gripper action < 0; ``pd_ee_delta_pos``: +1 open, -1 closed);
* ``tcp_to_obj`` (cube minus gripper centre, cm) at that step and at ``--look-at`` (default step 30);
* whether the grasp carried the cube: ``is_grasped`` with the cube ``LIFT`` above where it started.  ManiSkill's
  ``is_grasped`` reads contact forces, so it also fires for a few steps while the fingers squeeze an edge of the
  cube and slide off it, the cube still on the table;
* for episodes that grasp and never succeed, how the carry ends: ``slipped`` (the cube never lifted), ``dropped``
  (lifted, then the grasp is lost before the end, at ``lost_at_step``, after ``grasped_steps`` grasped steps) or
  held to the end; and the cube's closest approach to the goal and its offset there (``obj_to_goal``, goal minus
  cube, cm; placing needs < 2.5 cm);
* what stage 3's learning reward made of each such grasp (``--min-gap``, the target run's ``grasp_min_gap``): the steps
  the flag counted (``counted_steps``, the fingers >= the gap apart) against the steps it fired, and how far the
  cube rose meanwhile (``max_rise_cm``); and, over the successes, how many steps pass from the first counted grasp to
  the cube ``EARLY_LIFT`` up (``counted_to_lift_steps_p10_50_90``): what a reward that waited for the lift would delay.

It prints the episodes that never grasp and a summary, and writes ``outputs/benchmarks/grasp_failures/<name>.json``.

    .venv/bin/python benchmarks/grasp_failures.py outputs/03_reinflow/cpu_residual_step_s2/last.pt \\
        --episodes 96 --name residual_step_s2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from flowlib.envs.maniskill import make_env, resolve_backend
from flowlib.envs.tasks import PICKCUBE_FINGERS
from flowlib.infra.runs import run_dir, save_json
from flowlib.policies import bc
from flowlib.tools.evaluate import load_checkpoint_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark that reads PickCube's layout
from latent_steering import GRASPED, OBJ, OBJ_TO_GOAL, TCP, TCP_TO_OBJ, check_layout  # noqa: E402

GRIPPER = 3  # pd_ee_delta_pos: dx, dy, dz, gripper
LIFT = 0.02  # m: a grasp that raised the cube this far above its start carried it
EARLY_LIFT = 0.01  # m: the first centimetre of a carry


def lifted(obs: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool per step of an episode's observations ``[T+1, O]`` (the reset obs first): ``is_grasped`` after
    the step with the cube at least ``LIFT`` above its start."""
    rise = obs[1:, OBJ.start + 2] - obs[0, OBJ.start + 2]
    return (obs[1:, GRASPED] > 0.5) & (rise >= LIFT)


def episode_report(ep, grasped: bool, look_at: int) -> dict:
    """One recorded episode's grasp story (module docstring); offsets in cm, ``[dx, dy, dz]``."""
    obs, actions = torch.as_tensor(ep.obs), torch.as_tensor(ep.actions)  # [T+1, O], [T, A]
    check_layout(obs)
    if not torch.allclose(obs[:, TCP_TO_OBJ], obs[:, OBJ] - obs[:, TCP], atol=1e-4):
        raise ValueError(f"observation dims {TCP_TO_OBJ.start}:{TCP_TO_OBJ.stop} are not cube minus gripper: "
                         "not PickCube-v1's state layout")
    closed = torch.nonzero(actions[:, GRIPPER] < 0).flatten()
    t_close = int(closed[0]) if len(closed) else None
    grasp_steps = torch.nonzero(obs[1:, GRASPED] > 0.5).flatten()  # is_grasped after each step (not the reset obs)
    offset = lambda t: [round(100 * float(x), 1) for x in obs[t, TCP_TO_OBJ]]  # noqa: E731
    return {"seed": ep.seed, "success": bool(ep.success.any()), "grasped": grasped,
            "first_grasp_step": int(grasp_steps[0]) + 1 if len(grasp_steps) else None,
            "close_step": t_close, "offset_at_close_cm": offset(t_close) if t_close is not None else None,
            f"offset_at_{look_at}_cm": offset(min(look_at, len(actions))),
            "min_distance_cm": round(100 * float(obs[:, TCP_TO_OBJ].norm(dim=1).min()), 1)}


def counted(obs: torch.Tensor, min_gap: float) -> torch.Tensor:
    """``[T]`` bool: the grasp as stage 3's learning reward counts it after each step (``is_grasped`` with the fingers
    ``>= min_gap`` apart; ``flowlib.envs.smdp.ChunkRunner._grasped``), from an episode's observations ``[T+1, O]``."""
    return (obs[1:, GRASPED] > 0.5) & (obs[1:, PICKCUBE_FINGERS].sum(1) >= min_gap)


def counted_to_lift(ep, min_gap: float) -> int | None:
    """Steps from the first counted grasp to the first with the grasp counted and the cube ``EARLY_LIFT`` above its
    start (``None`` if either never happens)."""
    obs = torch.as_tensor(ep.obs)
    held = counted(obs, min_gap)
    up = torch.nonzero(held & (obs[1:, OBJ.start + 2] - obs[0, OBJ.start + 2] >= EARLY_LIFT)).flatten()
    first = torch.nonzero(held).flatten()
    return int(up[0] - first[0]) if len(up) else None


def carry_report(ep, min_gap: float = 0.035) -> dict:
    """An episode that grasps the cube and never places it: slipped, dropped or held, and how close the cube came
    (cm).  ``grasp_lost``: the flag is off at the end (a slip or a drop).  ``counted_steps``: the grasped steps with
    the fingers ``>= min_gap`` apart; ``max_rise_cm``: the cube's highest rise above its start while grasped."""
    obs = torch.as_tensor(ep.obs)                                    # [T+1, O]
    check_layout(obs)
    grasped = obs[1:, GRASPED] > 0.5  # after each step (the reset obs carries the previous episode's flag)
    steps = torch.nonzero(grasped).flatten()
    if not len(steps) or bool(ep.success.any()):
        raise ValueError(f"episode {ep.seed} {'succeeds' if len(steps) else 'never grasps'}: a carry report is for "
                         "episodes that grasp and never place the cube")
    to_goal = obs[1:, OBJ_TO_GOAL]                                   # [T, 3] goal minus cube
    t = int(to_goal.norm(dim=1).argmin())
    lost = not bool(grasped[-1])
    outcome = "held" if not lost else "dropped" if lifted(obs).any() else "slipped"
    rise = obs[1:, OBJ.start + 2] - obs[0, OBJ.start + 2]
    return {"seed": ep.seed, "outcome": outcome, "grasp_lost": lost, "grasped_steps": int(grasped.sum()),
            "counted_steps": int(counted(obs, min_gap).sum()), "max_rise_cm": round(100 * float(rise[grasped].max()), 2),
            "first_grasp_step": int(steps[0]) + 1, "lost_at_step": int(steps[-1]) + 2 if lost else None,
            "closest_to_goal_cm": round(100 * float(to_goal[t].norm()), 1),
            "offset_at_closest_cm": [round(100 * float(x), 1) for x in to_goal[t]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="stage-1/2 best_model.pt or stage-3 last.pt (PickCube-v1)")
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--num-envs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=30000)
    ap.add_argument("--K", type=int, default=4, help="inference steps of a stage-1/2 flow")
    ap.add_argument("--look-at", type=int, default=30, help="also report the offset at this step")
    ap.add_argument("--min-gap", type=float, default=0.035,
                    help="the finger gap (m) at which stage 3's reward counts a grasp (grasp_min_gap)")
    ap.add_argument("--name", default="default")
    args = ap.parse_args()
    torch.set_num_threads(1)  # leave the cores to the env workers
    out, t0 = {}, time.time()
    # on physx_cpu a fresh scene per episode, as flowlib.tools.evaluate: the same episodes, whatever ran before them
    fresh = resolve_backend("auto") == "physx_cpu"
    with make_env("PickCube-v1", args.num_envs, control_mode="pd_ee_delta_pos", fresh_scene=fresh) as env:
        for path in tqdm(args.checkpoints, desc="checkpoints"):
            policy, meta = load_checkpoint_policy(path)
            if meta["env_id"] != "PickCube-v1" or meta["control_mode"] != "pd_ee_delta_pos":
                raise ValueError(f"{path} is a {meta['env_id']} / {meta['control_mode']} policy: this script reads "
                                 "PickCube-v1 state observations and pd_ee_delta_pos actions")
            result = bc.evaluate(policy, env, args.episodes, args.K, seed=args.seed, record=True)
            grasped = result["per_episode_flags_once"]["is_grasped"]
            eps = [episode_report(ep, g, args.look_at) for ep, g in zip(result["rollouts"], grasped)]
            missed = [e for e in eps if not e["grasped"]]
            lateral = [float(np.hypot(*e["offset_at_close_cm"][:2])) for e in missed if e["offset_at_close_cm"]]
            first = sorted(e["first_grasp_step"] for e in eps if e["success"] and e["first_grasp_step"])
            carry = [carry_report(ep, args.min_gap) for ep, g in zip(result["rollouts"], grasped)
                     if g and not ep.success.any()]
            slipped = [c for c in carry if c["outcome"] == "slipped"]
            dropped = [c for c in carry if c["outcome"] == "dropped"]
            kept = [c["closest_to_goal_cm"] for c in carry if c["outcome"] == "held"]
            lags = [x for ep in result["rollouts"] if ep.success.any()
                    for x in [counted_to_lift(ep, args.min_gap)] if x is not None]
            # a goal within LIFT of the cube's start is placed without a lift: successes count as lifted
            lifts = float(np.mean([bool(lifted(torch.as_tensor(ep.obs)).any() or ep.success.any())
                                   for ep in result["rollouts"]]))
            out[path] = {"success_once": result["success_once"], "grasped": float(np.mean(grasped)),
                         "lifted_or_placed": lifts,
                         "never_grasped": len(missed), "lateral_miss_at_close_cm_median":
                         float(np.median(lateral)) if lateral else None,
                         "first_grasp_step_of_successes": [first[0], first[len(first) // 2], first[-1]] if first else None,
                         "never_grasped_episodes": missed, "grasped_not_placed": len(carry),
                         "slipped": len(slipped), "dropped": len(dropped),
                         "held_closest_to_goal_cm_median": float(np.median(kept)) if kept else None,
                         "slipped_counted_steps": sorted(c["counted_steps"] for c in slipped),
                         "slipped_max_rise_cm": sorted(c["max_rise_cm"] for c in slipped),
                         "counted_to_lift_steps_p10_50_90": [float(x) for x in np.percentile(lags, [10, 50, 90])]
                         if lags else None,
                         "grasped_not_placed_episodes": carry}
            print(f"\n{path}: success {result['success_once']:.3f}, grasped {np.mean(grasped):.3f} "
                  f"(lifted or placed {lifts:.3f}), "
                  f"{len(missed)} of {len(eps)} never grasp; successes first grasp at steps "
                  f"{out[path]['first_grasp_step_of_successes']} (min / median / max)")
            for e in missed:
                print(f"  seed {e['seed']}: closes at step {e['close_step']}, cube - gripper {e['offset_at_close_cm']} cm "
                      f"(at step {args.look_at}: {e[f'offset_at_{args.look_at}_cm']}), closest {e['min_distance_cm']} cm")
            print(f"  {len(carry)} grasp and never place: {len(slipped)} slip (the cube never lifted), {len(dropped)} "
                  f"drop it, {len(kept)} hold it to the end, closest to the goal {sorted(kept)} cm")
            print(f"  slips: steps counted as grasped (fingers >= {100 * args.min_gap:.1f} cm) "
                  f"{out[path]['slipped_counted_steps']}, highest rise while grasped {out[path]['slipped_max_rise_cm']} "
                  f"cm; successes: steps from the first counted grasp to a {100 * EARLY_LIFT:.0f} cm lift "
                  f"{out[path]['counted_to_lift_steps_p10_50_90']} (10th / 50th / 90th percentile)")
            for c in carry:
                lost = f" (lost at step {c['lost_at_step']})" if c["grasp_lost"] else ""
                print(f"  seed {c['seed']}: {c['outcome']}{lost} (grasped {c['grasped_steps']} steps from step "
                      f"{c['first_grasp_step']}, {c['counted_steps']} counted, rise {c['max_rise_cm']} cm), "
                      f"closest to the goal {c['closest_to_goal_cm']} cm, goal - cube {c['offset_at_closest_cm']} cm")
    path = run_dir("benchmarks", "grasp_failures") / f"{args.name}.json"
    save_json(path, {"episodes": args.episodes, "seed": args.seed, "K": args.K, "wall_s": time.time() - t0,
                     "checkpoints": out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
