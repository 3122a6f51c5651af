"""What did a per-chunk residual learn? Its mean correction per action dim, on the demonstrations' states.

A ``steer: residual`` checkpoint (``flowlib.methods.residual``) adds ``r ~ N(mu(o, a_b), sigma^2)`` to the executed actions
of the frozen flow's chunk; its deterministic policy adds ``mu``.  This script runs that deterministic decision on
observation windows taken from the stage-1 demonstrations (every ``--stride``-th step of each episode; the base chunk
from the checkpoint's own ``x_0 ~ N(0, I)``, seeded) and reports, per action dim (PickCube ``pd_ee_delta_pos``:
x, y, z, gripper), the mean ``|mu|``, the mean ``mu`` (a systematic push, e.g. on the gripper, shows here and not in
``|mu|``), and the share of entries beyond ``0.75 b`` (near the bound ``|mu| <= b``).  Units are the action
normaliser's, in which the demos span [-1, 1].  Writes ``outputs/benchmarks/residual_mean/<name>.json``.

    .venv/bin/python benchmarks/residual_mean.py outputs/03_reinflow/chunk_res_ppo_1m_s0/last.pt --name chunk_res_ppo_1m_s0
"""
from __future__ import annotations

import argparse

import torch

from flowlib.envs import data
from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import stage3
from flowlib.methods.residual import ResidualAgent


def demo_windows(episodes: list[data.Episode], obs_horizon: int, stride: int) -> torch.Tensor:
    """``[N, To, O]``: the window ending at every ``stride``-th step of each episode (its last obs excluded)."""
    wins = []
    for e in episodes:
        obs = torch.as_tensor(e.obs, dtype=torch.float32)
        wins += [obs[t - obs_horizon + 1:t + 1] for t in range(obs_horizon - 1, len(obs) - 1, stride)]
    return torch.stack(wins)


@torch.no_grad()
def residual_stats(agent: ResidualAgent, windows: torch.Tensor, generator: torch.Generator) -> dict:
    """Per action dim: mean ``|mu|``, mean ``mu`` and the share of entries with ``|mu| > 0.75 b``, over the windows
    and the residual's rows.  ``mu`` is read from the deterministic decision (row 0, the executed rows:
    ``flowlib.methods.residual``'s format)."""
    if not isinstance(agent, ResidualAgent):
        raise ValueError(f"this script reads a steer 'residual' checkpoint, got {type(agent).__name__}: "
                         "for steer 'residual_step' the correction is the actor's output at each env step")
    rows, start = agent._rows, agent.obs_horizon - 1  # r's rows (Ta or 1), the first executed row
    chain, _ = agent.sample(windows, generator, deterministic=True)
    mu = chain[:, 0, start:start + rows]                                        # [N, n, A]
    return {"windows": len(windows), "rows": rows, "bound": agent.residual_bound,
            "mean_abs_mu": mu.abs().mean((0, 1)).tolist(), "mean_mu": mu.mean((0, 1)).tolist(),
            "share_near_bound": (mu.abs() > 0.75 * agent.residual_bound).float().mean((0, 1)).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a stage-3 steer 'residual' last.pt / best_model.pt")
    ap.add_argument("--num-demos", type=int, default=150, help="which demo file of the env (data.demo_path)")
    ap.add_argument("--stride", type=int, default=4, help="a window at every stride-th step of each demo")
    ap.add_argument("--seed", type=int, default=0, help="seeds the base chunks' x_0")
    ap.add_argument("--name", default="default")
    args = ap.parse_args()
    _, cfg, agent, _ = stage3.load_for_rollouts(args.checkpoint)
    windows = demo_windows(data.load_demos(data.demo_path(cfg.env_id, args.num_demos)), agent.obs_horizon, args.stride)
    stats = residual_stats(agent, windows, torch.Generator().manual_seed(args.seed))
    stats.update(checkpoint=args.checkpoint, num_demos=args.num_demos, stride=args.stride, seed=args.seed)
    print(f"{stats['windows']} windows, rows {stats['rows']}, bound {stats['bound']}")
    for key in ("mean_abs_mu", "mean_mu", "share_near_bound"):
        print(f"  {key:>16}: " + " ".join(f"{v:+.3f}" for v in stats[key]))
    path = run_dir("benchmarks", "residual_mean") / f"{args.name}.json"
    save_json(path, stats)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
