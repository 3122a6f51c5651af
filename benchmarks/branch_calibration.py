"""Does the critic tell two branches apart? Its branch advantages against Monte-Carlo outcomes.

The branch advantage (``advantage: branch``) of two chunks tried from one state is
``Q_0 - Q_1`` with ``Q_m = R_m + gamma^tau V(s'_m)``: what it asks of the critic is the *difference* of V between
two nearby states, not V's level, which is what explained variance scores. This script measures that
difference against the truth. For each pair it saves the env state (``ManiSkillVecEnv.snapshot``), runs two
noisy chunks from it and, from each, the rest of the episode under the same noisy policy
(``reinflow.finish_episodes``; both continuations draw the same noise, common random numbers), so
``G_m = R_m + gamma^tau G(s'_m)`` is an unbiased sample of ``Q_m``. Then ``E[G_0 - G_1 | s'_0, s'_1] =
Q_0 - Q_1``: regressed on the critic's ``Q_0 - Q_1``, a calibrated critic gives a slope of 1, and one whose
local differences carry nothing gives 0. Branch points are spread over the episode (a random number of
noisy decisions first, up to ``--max-skip``); envs whose episode has ended by then are left out.

    .venv/bin/python benchmarks/branch_calibration.py outputs/03_reinflow/branch2_bonus4_s0/at_262k.pt \\
        --batches 64 --name bonus4_262k

Prints and writes (``outputs/benchmarks/branch_calibration/<name>.json``) the pairs, the slope +- SE and
Pearson r of ``G_0 - G_1`` on the critic's ``Q_0 - Q_1`` (``scipy.stats.linregress``), the share of pairs whose
signs agree among those where ``G`` differs, and, for contrast, r between the levels ``Q_0`` and ``G_0``.
Rewards are as learning sees them (``loop.learning_runner``). physx_cpu only.
"""
from __future__ import annotations

import argparse
import time

import torch
from scipy import stats
from tqdm import tqdm

from flowlib.envs.maniskill import make_env
from flowlib.infra.runs import run_dir, save_json
from flowlib.methods import reinflow, stage3
from flowlib.rl import loop
from flowlib.tools.run import parse_overrides


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a ReinFlow last.pt / best_model.pt (its critic is what is checked)")
    ap.add_argument("--batches", type=int, default=32, help="branch points per env")
    ap.add_argument("--num-envs", type=int, default=8)
    ap.add_argument("--max-skip", type=int, default=9, help="noisy decisions before a branch point: 0..max-skip")
    ap.add_argument("--noise-std", type=float, default=0.0, help="max_noise_std (0: the run's schedule)")
    ap.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seed", type=int, default=7_000_000, help="first env seed (away from training and evaluation)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="default")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.param)
    ckpt, cfg, agent, std = stage3.load_for_rollouts(args.checkpoint, overrides, args.noise_std)
    gen = torch.Generator().manual_seed(args.seed)
    q_hat, g, t0 = [[], []], [[], []], time.time()
    with torch.no_grad(), make_env(cfg.env_id, args.num_envs, max_episode_steps=cfg.max_episode_steps) as env:
        runner = loop.learning_runner(cfg, env, agent.obs_horizon, args.seed)
        for _ in tqdm(range(args.batches), desc="branch points", mininterval=10):
            runner.restart()
            for _ in range(int(torch.randint(args.max_skip + 1, (1,), generator=gen))):
                runner.step_chunk(agent.actions(agent.sample(runner.window, gen)[0]), auto_reset=False)
            live, saved = runner.active.clone(), runner.save()
            continuation_seed = int(torch.randint(2**31, (1,), generator=gen))
            for m in range(2):
                runner.rewind(saved)
                out = runner.step_chunk(agent.actions(agent.sample(runner.window, gen)[0]), auto_reset=False)
                next_value = torch.where(out["terminal"], 0.0, agent.value(out["next_window"]))     # [N]
                rest = finish_episodes_after(agent, runner, out, next_value, continuation_seed)
                q_hat[m].append((out["reward"] + out["discount"] * next_value)[live])
                g[m].append((out["reward"] + out["discount"] * rest)[live])
            runner.pop_finished()
    q0, q1, g0, g1 = (torch.cat(x) for x in (*q_hat, *g))
    dq, dg = q0 - q1, g0 - g1
    fit = stats.linregress(dq.numpy(), dg.numpy())
    moved = dg != 0
    result = {"checkpoint": args.checkpoint, "env_steps": ckpt["env_steps"], "max_noise_std": std, "reward": cfg.reward,
              "pairs": len(dq), "seconds": time.time() - t0, "slope": fit.slope, "slope_se": fit.stderr,
              "r": fit.rvalue, "std_dq": float(dq.std()), "std_dg": float(dg.std()),
              "sign_agreement": float((torch.sign(dq[moved]) == torch.sign(dg[moved])).float().mean()),
              "pairs_g_differs": int(moved.sum()), "r_levels": float(torch.corrcoef(torch.stack([q0, g0]))[0, 1])}
    print(f"{result['pairs']} pairs in {result['seconds']:.0f} s ({args.checkpoint}, reward {cfg.reward}, max std {std:.3f})")
    print(f"  G_0 - G_1 on the critic's Q_0 - Q_1: slope {fit.slope:.3f} +- {fit.stderr:.3f}, r {fit.rvalue:.3f}; "
          f"signs agree in {result['sign_agreement']:.2f} of the {result['pairs_g_differs']} pairs where G differs")
    print(f"  std of Q_0 - Q_1 {result['std_dq']:.4f}, of G_0 - G_1 {result['std_dg']:.4f}; "
          f"levels: r(Q_0, G_0) {result['r_levels']:.3f}")
    path = run_dir("benchmarks", "branch_calibration") / f"{args.name}.json"
    save_json(path, result)
    print(f"wrote {path}")
    return result


def finish_episodes_after(agent, runner, out, next_value, seed: int) -> torch.Tensor:
    """``G(s')`` per env after a branch chunk ``out``: the Monte-Carlo rest of the episode, with the continuation's
    noise drawn from ``seed`` (the same for both branches); an env the chunk ended keeps its bootstrap."""
    rest = reinflow.finish_episodes(agent, runner, torch.Generator().manual_seed(seed))
    return torch.where(out["end"], next_value, rest)


if __name__ == "__main__":
    main()
