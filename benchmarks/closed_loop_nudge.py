"""What a per-step, closed-loop correction of the stage-1 policy could buy on PickCube, and what a bias costs.

Not a learner: a diagnostic that bounds what ``steer: residual_step`` (``flowlib.methods.residual_step``) is after. The
stage-1 flow runs as evaluated everywhere else (a chunk per decision from ``x_0 ~ N(0, I)``, 8 actions open loop),
and every executed action is corrected from the *current* observation before it runs, through the same
``correct_step`` seam that ``flowlib.policies.bc.evaluate`` calls for a learned residual:

* ``nudge k``: while the cube is grasped, add ``k * obj_to_goal / 0.1 m`` to the gripper's xyz action
  (``pd_ee_delta_pos``: an action of 1 asks for a 10 cm move), so the target moves ``k`` of the way to the goal;
* ``bias y=c`` (normalised action units): add a constant ``c`` to one axis at every step: the kind of small,
  systematic error a learned residual makes when its critic's slope in ``r`` is noise.

Every row meets the same episodes (``--seed``..), paired with the plain stage-1 policy (``flowlib.infra.metrics``);
prints the table and writes ``outputs/benchmarks/closed_loop_nudge/<name>.json``.

    .venv/bin/python benchmarks/closed_loop_nudge.py outputs/01_shortcut_bc/cpu100/best_model.pt \\
        --nudge 0.1 0.3 1.0 --bias y=0.04 z=-0.04 --episodes 200 --name cpu100
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from flowlib.envs.maniskill import make_env
from flowlib.infra.metrics import paired_means, success_rates
from flowlib.infra.runs import run_dir, save_json
from flowlib.policies import bc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark that reads PickCube's layout
from latent_steering import GRASPED, OBJ_TO_GOAL, check_layout  # noqa: E402

AXIS = {"x": 0, "y": 1, "z": 2}


class Corrected(bc.ChunkPolicy):
    """The stage-1 policy with a fixed per-step correction (``kind`` "nudge" or "bias"; module docstring)."""

    closed_loop = True

    def __init__(self, policy, kind: str, value: float, axis: int = 0):
        super().__init__()
        self.policy, self.kind, self.value, self.axis = policy, kind, value, axis
        self.obs_horizon, self.pred_horizon = policy.obs_horizon, policy.pred_horizon
        self.action_dim, self.act_horizon = policy.action_dim, policy.act_horizon

    def act(self, obs_window, num_steps, x0=None, **kwargs):
        return self.policy.act(obs_window, num_steps, x0=x0, **kwargs)

    @torch.no_grad()
    def correct_step(self, obs_window: torch.Tensor, action: torch.Tensor) -> torch.Tensor:  # [B, To, O], [B, A]
        obs = obs_window[:, -1]
        check_layout(obs)
        a = action.clone()
        if self.kind == "nudge":
            grasped = obs[:, GRASPED:GRASPED + 1] > 0.5
            a[:, :3] = torch.where(grasped, a[:, :3] + self.value * obs[:, OBJ_TO_GOAL] / 0.1, a[:, :3])
        else:
            norm = self.policy.action_normalizer
            shift = torch.zeros_like(a)
            shift[:, self.axis] = self.value
            a = norm.unnormalize(norm.normalize(a) + shift)
        return a.clamp(-1.0, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a stage-1/2 best_model.pt (PickCube-v1, pd_ee_delta_pos)")
    ap.add_argument("--nudge", type=float, nargs="*", default=[0.3], help="gains k of the goal nudge while grasped")
    ap.add_argument("--bias", nargs="*", default=[], help="constant biases, axis=value in normalised units: y=0.04")
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--num-envs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=30000)
    ap.add_argument("--K", type=int, default=4, help="inference steps of the flow")
    ap.add_argument("--name", default="default")
    args = ap.parse_args()
    torch.set_num_threads(1)
    policy = bc.load_policy(args.checkpoint)
    if policy.meta["env_id"] != "PickCube-v1" or policy.meta["control_mode"] != "pd_ee_delta_pos":
        raise ValueError(f"{args.checkpoint} is a {policy.meta['env_id']} / {policy.meta['control_mode']} policy: "
                         "this script reads PickCube-v1 observations and pd_ee_delta_pos actions")
    rows = {"stage 1": policy}
    rows.update({f"nudge k={k}": Corrected(policy, "nudge", k) for k in args.nudge})
    for spec in args.bias:
        axis, _, value = spec.partition("=")
        if axis not in AXIS or not value:
            raise ValueError(f"--bias {spec!r}: write axis=value with axis x, y or z, e.g. y=0.04")
        rows[f"bias {spec}"] = Corrected(policy, "bias", float(value), AXIS[axis])
    results, t0 = {}, time.time()
    with make_env("PickCube-v1", args.num_envs, control_mode="pd_ee_delta_pos") as env:
        for name, p in rows.items():
            results[name] = bc.evaluate(p, env, args.episodes, args.K, seed=args.seed)
    table = success_rates({n: r["per_episode_success_once"] for n, r in results.items()})
    returns = paired_means({n: r["per_episode_return"] for n, r in results.items()})
    for row, ret in zip(table, returns):
        r = results[row["policy"]]
        row.update({"success_at_end": r["success_at_end"], "return_diff": ret["diff"], "return_diff_se": ret["diff_se"],
                    **{f"{flag}_once": rate for flag, rate in r["flags_once"].items()}})
    print(f"{'policy':16s} {'success':>8s} {'minus stage 1':>16s} {'at end':>7s} {'grasped':>8s} {'placed':>7s}")
    for row in table:
        print(f"{row['policy']:16s} {row['success']:8.3f} {row['diff']:+8.3f} +- {row['diff_se']:.3f} "
              f"{row['success_at_end']:7.3f} {row.get('is_grasped_once', float('nan')):8.3f} "
              f"{row.get('is_obj_placed_once', float('nan')):7.3f}")
    out = run_dir("benchmarks", "closed_loop_nudge") / f"{args.name}.json"
    save_json(out, {"checkpoint": args.checkpoint, "episodes": args.episodes, "seed": args.seed, "K": args.K,
                    "wall_s": time.time() - t0, "rows": table})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
