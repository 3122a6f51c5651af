"""How far can steering the latent noise ``x_0`` move a flow policy's chunk? (DSRL's authority, PickCube)

DSRL (Wagenmaker et al. 2025) leaves the flow's weights alone and learns which ``x_0`` to start the chain
from; the latent policy's output is bounded, ``x_0 in [-b, b]^(H x A)`` (a tanh-squashed Gaussian). Whatever
it learns, it can only pick among the chunks the frozen map ``x_0 -> chunk`` reaches. This script measures
that reach on a stage-1 checkpoint, in the simulator:

1. Run the deterministic policy (each decision's ``x_0 ~ N(0, I)``) on fresh episodes and stop at a random
   decision (0..``--max-skip`` chunks in); save the state (``ManiSkillVecEnv.snapshot``, physx_cpu).
2. From that state, execute ``--draws`` chunks from fresh ``x_0 ~ N(0, I)``: the policy's own spread, and the
   baseline position of the gripper (TCP) and of the cube after one chunk.
3. For each bound ``b`` and each direction ``u`` (the six axes, and per state the unit vector from the cube to
   the goal), find the ``x_0 = b tanh(w)`` that maximises ``u . sum_k a_k[xyz]``, the gripper move the chunk's
   executed actions command (``pd_ee_delta_pos``: an action of 1 asks for 10 cm), by ``--opt-steps`` Adam
   steps through the deterministic chain (``FlowPolicy.chunk``, differentiable in ``x_0``); execute it and
   measure where the TCP and the cube end up.

Prints and writes (``outputs/benchmarks/latent_steering/<name>.json``): per bound, the median over states of
the TCP shift along each axis beyond the baseline mean (mm; both signs of an axis averaged), the policy's own
spread over ``x_0 ~ N(0, I)``, and on the *carry* states (cube grasped, 2.5-8 cm from the goal: where the
start policy's failures are) how much closer to the goal one steered chunk brings the cube than the
policy's own chunk does, and how often steering drops the cube.

    .venv/bin/python benchmarks/latent_steering.py outputs/01_shortcut_bc/cpu100/best_model.pt --name cpu100

PickCube-v1 state observations only (the TCP, goal and cube positions are read from fixed slices of them,
checked against ``obj_to_goal_pos``).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from tqdm import tqdm

from flowlib.envs import smdp
from flowlib.envs.maniskill import make_env
from flowlib.envs.tasks import PICKCUBE_GOAL as GOAL  # PickCube-v1's
from flowlib.envs.tasks import PICKCUBE_GRASPED as GRASPED
from flowlib.envs.tasks import PICKCUBE_OBJ as OBJ
from flowlib.envs.tasks import PICKCUBE_OBJ_TO_GOAL as OBJ_TO_GOAL  # state layout (flowlib.envs.tasks)
from flowlib.envs.tasks import PICKCUBE_OBS_DIM
from flowlib.envs.tasks import PICKCUBE_TCP as TCP
from flowlib.envs.tasks import PICKCUBE_TCP_TO_OBJ as TCP_TO_OBJ
from flowlib.infra.runs import run_dir, save_json
from flowlib.policies import bc

AXES = torch.cat([torch.eye(3), -torch.eye(3)])  # [6, 3]: +x +y +z -x -y -z


def check_layout(obs: torch.Tensor) -> None:
    if (obs.shape[-1] != PICKCUBE_OBS_DIM
            or not torch.allclose(obs[:, OBJ_TO_GOAL], obs[:, GOAL] - obs[:, OBJ], atol=1e-4)):
        raise ValueError(f"this script reads PickCube-v1 state observations ({PICKCUBE_OBS_DIM} dims, obj_to_goal_pos "
                         f"last); got {obs.shape[-1]} dims that do not match that layout")


def steer(policy: bc.FlowPolicy, window: torch.Tensor, u: torch.Tensor, bound: float, K: int, steps: int, lr: float):
    """``x_0 [B, H, A]`` in ``[-bound, bound]`` maximising ``u . sum_k a_k[:3]`` over the executed actions.
    ``window [B, To, O]``, ``u [B, 3]``; starts from ``x_0 = 0`` (the latent's mode)."""
    start = policy.obs_horizon - 1
    w = torch.zeros(len(window), policy.pred_horizon, policy.action_dim, requires_grad=True)
    opt = torch.optim.Adam([w], lr=lr)
    for _ in range(steps):
        a = policy.chunk(window, bound * torch.tanh(w), K)[:, start:start + policy.act_horizon]  # [B, Ta, A]
        loss = -(a[..., :3].sum(1) * u).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (bound * torch.tanh(w)).detach()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a stage-1 / stage-2 checkpoint (best_model.pt)")
    ap.add_argument("--K", type=int, default=4, help="inference steps")
    ap.add_argument("--bounds", type=float, nargs="+", default=[2.5], help="latent bounds b for the axis shifts")
    ap.add_argument("--ladder", type=float, nargs="+", default=[0.5, 1.0, 2.5],
                    help="latent bounds tried towards the goal (the closest result counts)")
    ap.add_argument("--states", type=int, default=80, help="carry states to measure")
    ap.add_argument("--max-batches", type=int, default=100, help="give up after this many batches of episodes")
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--draws", type=int, default=4, help="chunks from x_0 ~ N(0, I) per state (the baseline)")
    ap.add_argument("--max-decisions", type=int, default=12, help="deterministic decisions per episode")
    ap.add_argument("--opt-steps", type=int, default=25)
    ap.add_argument("--opt-lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=8_000_000, help="first env seed (away from training and evaluation)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    policy = bc.load_policy(args.checkpoint).eval()
    gen = torch.Generator().manual_seed(args.seed)
    N = args.num_envs
    shape = (N, policy.pred_horizon, policy.action_dim)
    start = policy.obs_horizon - 1

    def actions(window, x0):  # executed actions in env units, [N, Ta, A]
        with torch.no_grad():
            return policy.chunk(window, x0, args.K)[:, start:start + policy.act_horizon].clamp(-1.0, 1.0)

    rows, t0 = [], time.time()
    with make_env("PickCube-v1", N) as env, tqdm(total=args.states, desc="carry states", mininterval=10) as bar:
        runner = smdp.ChunkRunner(env, policy.obs_horizon, gamma=1.0, first_seed=args.seed)
        for _ in range(args.max_batches):
            if len(rows) >= args.states:
                break
            runner.restart()
            uses = torch.zeros(N, dtype=torch.long)
            for _ in range(args.max_decisions):
                window = runner.window.clone()
                obs = window[:, -1]
                check_layout(obs)
                to_goal = obs[:, GOAL] - obs[:, OBJ]
                dist = to_goal.norm(dim=1)
                carry = runner.active & (obs[:, GRASPED] > 0.5) & (dist > 0.025) & (dist < 0.08) & (uses < 2)
                if carry.any():
                    uses += carry.long()
                    saved = runner.save()

                    def after(x0):  # the observation after executing x0's chunk from the saved state, [N, O]
                        runner.step_chunk(actions(window, x0), auto_reset=False)
                        out = runner.window[:, -1].clone()
                        runner.rewind(saved)
                        return out

                    base = torch.stack([after(torch.randn(shape, generator=gen)) for _ in range(args.draws)])  # [M, N, O]
                    towards = to_goal / dist[:, None].clamp(min=1e-6)
                    plan = [(b, AXES[j].expand(N, 3)) for b in args.bounds for j in range(6)]
                    plan += [(b, towards) for b in args.ladder]
                    x0 = torch.cat([steer(policy, window, u, b, args.K, args.opt_steps, args.opt_lr) for b, u in plan])
                    steered = torch.stack([after(x) for x in x0.view(len(plan), *shape)])  # [P, N, O]
                    for i in torch.nonzero(carry).squeeze(1).tolist():
                        goal, base_obj, base_tcp = obs[i, GOAL], base[:, i, OBJ], base[:, i, TCP]
                        base_d = (base_obj - goal).norm(dim=1)                          # [M]
                        shift = ((steered[:6 * len(args.bounds), i, TCP] - base_tcp.mean(0)).view(-1, 6, 3)
                                 * AXES).sum(-1)                                        # [bounds, 6]
                        ladder = steered[6 * len(args.bounds):, i]                      # [L, O]
                        ladder_d = (ladder[:, OBJ] - goal).norm(dim=1)
                        best = int(ladder_d.argmin())
                        rows.append({"goal_dist": float(dist[i]), "spread_mm": float(1000 * base_tcp.std(0).norm()),
                                     "base_goal_dist": base_d.tolist(),
                                     "axis_shift_mm": (1000 * (shift[:, :3] + shift[:, 3:]) / 2).tolist(),
                                     "ladder_goal_dist": ladder_d.tolist(),
                                     "best_still_grasped": bool(ladder[best, GRASPED] > 0.5)})
                    bar.update(int(carry.sum()))
                runner.step_chunk(actions(window, torch.randn(shape, generator=gen)), auto_reset=False)
                if not runner.active.any():
                    break
    if not rows:
        raise SystemExit(f"no carry state (cube grasped, 2.5-8 cm from the goal) in {args.max_batches} x {N} episodes "
                         f"of {args.checkpoint}: this measures a policy that grasps; train one with notebook 01")
    mm = lambda x: 1000 * np.asarray(x)  # noqa: E731
    base_d = mm([r["base_goal_dist"] for r in rows])        # [S, M]
    ladder_d = mm([r["ladder_goal_dist"] for r in rows])    # [S, L]
    shifts = np.array([r["axis_shift_mm"] for r in rows])   # [S, bounds, 3]
    start_d = mm([r["goal_dist"] for r in rows])
    out = {"checkpoint": args.checkpoint, "K": args.K, "states": len(rows), "wall_s": time.time() - t0,
           "args": vars(args), "spread_mm_median": float(np.median([r["spread_mm"] for r in rows])),
           "goal_dist_mm_median": {"before": float(np.median(start_d)), "policy_chunk": float(np.median(base_d)),
                                   "best_of_draws": float(np.median(base_d.min(1))),
                                   "best_steered": float(np.median(ladder_d.min(1)))},
           "placed_after_one_chunk": {"policy_chunk": float((base_d < 25).mean()),
                                      "best_of_draws": float((base_d.min(1) < 25).mean()),
                                      "best_steered": float((ladder_d.min(1) < 25).mean())},
           "best_steered_still_grasped": float(np.mean([r["best_still_grasped"] for r in rows])),
           "axis_shift_mm_median": {str(b): np.median(shifts[:, j], 0).tolist() for j, b in enumerate(args.bounds)}}
    print(f"{len(rows)} carry states (cube grasped, 2.5-8 cm from the goal), {out['wall_s']:.0f} s; the policy's own "
          f"TCP spread after one chunk over x_0 ~ N(0, I): median {out['spread_mm_median']:.1f} mm")
    print("| bound b | TCP shift beyond the policy's chunk by steering x_0 along an axis, median mm (x / y / z) |")
    print("|---|---|")
    for b, v in out["axis_shift_mm_median"].items():
        print(f"| {b} | {' / '.join(f'{x:.1f}' for x in v)} |")
    g, p = out["goal_dist_mm_median"], out["placed_after_one_chunk"]
    print(f"| after one chunk | cube-goal distance, median mm | cube within 2.5 cm (placed) |\n|---|---|---|\n"
          f"| before the chunk | {g['before']:.1f} | 0 |\n"
          f"| the policy's chunk (x_0 ~ N(0, I)) | {g['policy_chunk']:.1f} | {p['policy_chunk']:.2f} |\n"
          f"| the best of {args.draws} such draws | {g['best_of_draws']:.1f} | {p['best_of_draws']:.2f} |\n"
          f"| steered towards the goal, the best of b in {args.ladder} | {g['best_steered']:.1f} | "
          f"{p['best_steered']:.2f} (still grasped: {out['best_steered_still_grasped']:.2f}) |")
    out["rows"] = rows
    path = run_dir("benchmarks", "latent_steering") / f"{args.name}.json"
    save_json(path, out)
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
