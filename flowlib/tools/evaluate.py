"""Evaluate checkpoints of any stage on the same held-out episodes, with standard errors.

    python -m flowlib.evaluate outputs/01_shortcut_bc/cpu100/best_model.pt \\
        outputs/03_reinflow/cpu_dense_150k_s{0,1,2}/last.pt --episodes 200 --num-envs 8 --run-name reinflow_150k
    python -m flowlib.evaluate outputs/01_shortcut_bc/cpu100/best_model.pt --act-horizon 8 4 2 --run-name horizons

Each checkpoint (stage 1 or 2 ``best_model.pt``, stage 3 ``last.pt`` / ``best_model.pt``) runs its
deterministic policy on episodes ``seed .. seed + episodes - 1``.  Episode ``i``'s env seed and policy
noise both come from ``seed + i`` (``flowlib.policies.bc.evaluate``), and on ``physx_cpu`` every episode starts in a
freshly built scene (``flowlib.envs``, ``fresh_scene``), so every checkpoint meets the same episodes whatever
``--num-envs`` is and whatever ran before it (the policy's batched forward rounds floats by its batch size, so
a borderline episode can still flip between ``--num-envs`` values: 1 of 100 seen; compare at one value), and each
one's gain over the first is a paired difference
(``flowlib.infra.metrics.success_rates``); so is its gain in return, the env's normalized dense reward summed
over the episode (``return_diff``, ``flowlib.infra.metrics.paired_means``).  ``--act-horizon`` re-runs each
checkpoint executing that many actions of every chunk (re-planning more or less often than it was trained
to; rows ``<label>@ah<n>``).  ``--noisy`` runs stage-3 checkpoints with their exploration noise (rows
``<label>@noisy``): the policy PPO improves, next to the deterministic one it deploys; their step noise is
one stream per checkpoint, so those rows depend on ``--num-envs``.  ``--steps 1 2 4`` scores each checkpoint at
each number of denoising steps (rows ``<label>@K<n>``): a stage-1/2 policy's ODE (stage 1's diffusion baseline's
denoising chain, by each ``--sampler ddpm ddim``: rows ``@ddpm`` / ``@ddim``), and a chain ReinFlow agent's
fine-tuned velocity net at step size ``1/K`` (``ReinFlowAgent.set_inference_steps``), so it shows whether RL kept
ShortCut's few-step property.  ``--zero-x0`` starts every chunk's denoising at ``x_0 = 0`` instead of a draw
(label the run: rows keep their names).  Writes ``results.csv`` (one row per
checkpoint), ``per_episode.csv`` (success), ``per_episode_return.csv`` and ``summary.json`` under
``outputs/evaluate/<run_name>/``.  Where the task reports more evaluation flags than success (PickCube:
``is_grasped``, ``is_obj_placed``, ``is_robot_static``), each row also gives the share of episodes in which
each was true at some step (``<flag>_once``; per episode in ``per_episode_flags.csv``): a failure breakdown,
e.g. episodes that grasp the cube but never bring it to the goal.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from flowlib.envs import visual
from flowlib.envs.maniskill import make_env, resolve_backend
from flowlib.flows.diffusion import SAMPLERS
from flowlib.infra import progress
from flowlib.infra.metrics import paired_means, success_rates
from flowlib.infra.runs import load_torch, provenance, run_dir, save_json, save_text, shown
from flowlib.methods import stage3
from flowlib.policies import bc, chunk_policy
from flowlib.rl import loop


def load_checkpoint_policy(path: str | Path, noisy: bool = False):
    """The policy in a stage-1/2 flow-policy or stage-3 ReinFlow checkpoint, in eval mode, and its metadata.
    With ``noisy`` a stage-3 agent carries the exploration noise its run had at the checkpoint's env steps."""
    ckpt = load_torch(path, "pass the best_model.pt / last.pt of a finished run")
    fmt = ckpt.get("format") if isinstance(ckpt, dict) else None
    if fmt == loop.CHECKPOINT_FORMAT:
        agent = stage3.load_for_rollouts(path)[2] if noisy else stage3.load_agent(path)
        return agent, agent.meta
    policy = chunk_policy.load_policy(path)  # raises a clear error for anything that is not a flow policy
    return policy, policy.meta


def set_act_horizon(policy, act_horizon: int) -> None:
    """Execute ``act_horizon`` actions of each predicted chunk (``chunk[To-1 : To-1+act_horizon]``)."""
    policy.act_horizon = chunk_policy.check_act_horizon(act_horizon, policy.obs_horizon, policy.pred_horizon)


def labels(paths: list[str | Path]) -> dict[Path, str]:
    """A short, unique name per checkpoint: ``<run>/<file>`` (e.g. ``cpu_dense_150k_s0/last.pt``), with as many
    more parent folders as it takes to tell two apart (``push_cube_cpu/seed_0/last.pt`` next to
    ``push_cube_cpu_demos_control/seed_0/last.pt``).  The same file given twice is an error."""
    parts = [Path(p).parts for p in paths]
    if len(set(parts)) != len(parts):
        raise ValueError(f"a checkpoint is given twice ({[str(p) for p in paths]}); give each once")
    names = {}
    for p in parts:
        n = next((n for n in range(min(2, len(p)), len(p)) if all(p[-n:] != q[-n:] for q in parts if q != p)), len(p))
        names[Path(*p)] = "/".join(p[-n:])
    return names


def label(name: str, act_horizon: int | None = None, noisy: bool = False, steps: int | None = None,
          sampler: str | None = None) -> str:
    """A row's name: the checkpoint's (``labels``), ``@ah<n>`` with an act-horizon override, ``@noisy`` for a
    stage-3 policy run with its exploration noise, ``@K<n>`` at a chosen number of denoising steps, ``@ddpm`` /
    ``@ddim`` for a diffusion policy's sampler."""
    return (name + ("" if act_horizon is None else f"@ah{act_horizon}") + ("@noisy" if noisy else "")
            + ("" if steps is None else f"@K{steps}") + ("" if sampler is None else f"@{sampler}"))


def samplers_of(policy, samplers: list[str] | None) -> list[str | None]:
    """The samplers to score ``policy`` with: each of ``samplers`` for stage 1's diffusion baseline (a DDPM policy),
    ``[None]`` (its own) for it without them and for every other policy (a flow's ODE has one sampler)."""
    if not samplers or getattr(policy, "meta", {}).get("model") != "ddpm":
        return [None]
    return list(samplers)


def set_steps(policy, steps: int | None, inference_steps: int) -> int:
    """The ``num_steps`` to pass ``bc.evaluate`` for ``policy`` at ``steps`` denoising steps (``None``: its own),
    setting a chain agent's K; a stage-3 policy that is not a chain (a steer of a frozen flow, a Gaussian) is
    refused in one line."""
    if steps is None:
        return inference_steps
    if hasattr(policy, "set_inference_steps"):
        policy.set_inference_steps(steps)
    elif not isinstance(policy, chunk_policy.FlowPolicy):
        raise ValueError(f"--steps applies to flow policies and chain ReinFlow agents; a {type(policy).__name__} "
                         "has no number of denoising steps to set: evaluate it without --steps")
    return steps


def evaluate_checkpoints(paths: list[str | Path], episodes: int, num_envs: int, seed: int, inference_steps: int,
                         backend: str = "auto", max_episode_steps: int | None = None,
                         act_horizons: list[int] | None = None, noisy: bool = False,
                         fresh_scene: bool | None = None, steps: list[int] | None = None,
                         samplers: list[str] | None = None, zero_x0: bool = False) -> dict[str, dict]:
    """``{label: bc.evaluate result}`` for each checkpoint (at each of ``act_horizons``, when given),
    all on the same episodes and one env.  ``noisy``: stage-3 checkpoints sample their noisy chain (the policy
    that collected their training data), each from a generator seeded with ``seed``, so all of them meet the
    same noise stream; stage-1/2 checkpoints, which have no exploration noise, stay deterministic.
    ``fresh_scene`` (default: on ``physx_cpu``) rebuilds the scene at every reset, so that a checkpoint's
    episodes do not depend on the ones run before them (``flowlib.envs``).  ``samplers`` ("ddpm", "ddim"): each
    diffusion-baseline checkpoint at each (rows ``@ddpm`` / ``@ddim``); other checkpoints are scored once."""
    names = labels(paths)
    unknown = sorted(set(samplers or []) - set(SAMPLERS))
    if unknown or len(set(samplers or [])) != len(samplers or []):
        raise ValueError(f"samplers {samplers}: give each of {SAMPLERS} at most once")
    loaded = {p: load_checkpoint_policy(p, noisy) for p in paths}
    horizons, step_counts = act_horizons or [None], steps or [None]
    for what, values in (("act horizons", horizons), ("step counts", step_counts)):
        if len(set(values)) != len(values):
            raise ValueError(f"{what} {values} repeat a value; give each once")
    for policy, _ in loaded.values():  # fail before the env starts
        for ah in horizons:
            if ah is not None:
                chunk_policy.check_act_horizon(ah, policy.obs_horizon, policy.pred_horizon)
        for K in step_counts:
            set_steps(policy, K, inference_steps)
    env_ids = {meta["env_id"] for _, meta in loaded.values()}
    modes = {meta["control_mode"] for _, meta in loaded.values()}
    if len(env_ids) != 1 or len(modes) != 1:
        raise ValueError(f"the checkpoints were trained on different envs or control modes ({env_ids}, {modes}); "
                         "compare only checkpoints of one task")
    views = {json.dumps(visual.policy_env_kwargs(meta), sort_keys=True) for _, meta in loaded.values()}
    if len(views) != 1:
        raise ValueError(f"the checkpoints read different observations ({sorted(views)}): evaluate each obs_mode "
                         "(state, rgb, ...) in its own call")
    if fresh_scene is None:
        fresh_scene = resolve_backend(backend) == "physx_cpu"
    results = {}
    with make_env(env_ids.pop(), num_envs, control_mode=modes.pop(), backend=backend,
                  max_episode_steps=max_episode_steps, fresh_scene=fresh_scene, **json.loads(views.pop())) as env:
        for path, (policy, meta) in progress.bar(iterable=loaded.items(), total=len(loaded), desc="checkpoints"):
            chunk_policy.check_compatible(meta, env.spec)
            explores = noisy and hasattr(policy, "explore")  # a stage-3 agent: its training-time draws
            for ah in horizons:
                if ah is not None:
                    set_act_horizon(policy, ah)
                for K in step_counts:
                    num_steps = set_steps(policy, K, inference_steps)
                    for sampler in samplers_of(policy, samplers):
                        if sampler is not None:
                            policy.flow.sampler = sampler
                        if explores:
                            policy.explore = torch.Generator().manual_seed(seed)
                        result = bc.evaluate(policy, env, episodes, num_steps, seed=seed, zero_x0=zero_x0)
                        results[label(names[Path(path)], ah, explores, K, sampler)] = {
                            **result, "act_horizon": policy.act_horizon}
    return results


def write_report(run_path: Path, results: dict[str, dict], seed: int, source: dict | None = None) -> list[dict]:
    """The files of an evaluation (module docstring); ``source``, where it came from (``runs.provenance`` and the
    checkpoints it scored), goes into ``summary.json`` for ``flowlib.tools.results publish``."""
    rows = success_rates({name: r["per_episode_success_once"] for name, r in results.items()})
    returns = paired_means({name: r["per_episode_return"] for name, r in results.items()})
    for row, ret in zip(rows, returns):
        row["success_at_end"] = results[row["policy"]]["success_at_end"]
        row.update({"return": ret["mean"], "return_diff": ret["diff"], "return_diff_se": ret["diff_se"]})
        row["act_horizon"] = results[row["policy"]]["act_horizon"]
        row.update({f"{name}_once": rate for name, rate in results[row["policy"]].get("flags_once", {}).items()})
    per_episode = pd.DataFrame({name: r["per_episode_success_once"] for name, r in results.items()}).astype(int)
    per_episode.insert(0, "env_seed", seed + per_episode.index)
    per_episode_return = pd.DataFrame({name: r["per_episode_return"] for name, r in results.items()})
    per_episode_return.insert(0, "env_seed", seed + per_episode_return.index)
    flags = pd.concat([pd.DataFrame({"env_seed": seed + np.arange(len(r["per_episode_success_once"])), "policy": name,
                                     **r.get("per_episode_flags_once", {})}) for name, r in results.items()])
    save_text(run_path / "results.csv", pd.DataFrame(rows).to_csv(index=False))
    save_text(run_path / "per_episode_flags.csv", flags.to_csv(index=False))
    save_text(run_path / "per_episode.csv", per_episode.to_csv(index=False))
    save_text(run_path / "per_episode_return.csv", per_episode_return.to_csv(index=False))
    save_json(run_path / "summary.json", {"seed": seed, **(source or {}), "rows": rows})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowlib.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="the first one is the reference for the paired differences")
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--num-envs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=20_000, help="first env seed (20000: the held-out eval_seed)")
    ap.add_argument("--inference-steps", type=int, default=4, help="ODE steps of stage-1/2 policies (stage 3 uses its K)")
    ap.add_argument("--act-horizon", type=int, nargs="+", default=None, metavar="N",
                    help="actions executed per chunk (default: each checkpoint's own); several: one row per value")
    ap.add_argument("--steps", type=int, nargs="+", default=None, metavar="K",
                    help="denoising steps: each checkpoint at each K (a chain agent's fine-tuned net at step 1/K); "
                         "rows <label>@K<n>")
    ap.add_argument("--sampler", nargs="+", default=None, choices=SAMPLERS, metavar="NAME",
                    help="diffusion-baseline checkpoints (model: ddpm): score each with each sampler, ddpm and/or "
                         "ddim (rows <label>@<sampler>); default: its own. Other checkpoints are scored once")
    ap.add_argument("--zero-x0", action="store_true",
                    help="start every chunk's denoising at x_0 = 0 (the noise's mode, DSRL's start) instead of a draw")
    ap.add_argument("--max-episode-steps", type=int, default=None, help="default: the task's evaluation length")
    ap.add_argument("--noisy", action="store_true",
                    help="stage-3 checkpoints run their noisy chain (the noise their run had at that point)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--reuse-scene", action="store_true",
                    help="physx_cpu: keep each worker's scene across resets (~5%% faster; episodes then depend on "
                         "the ones run before them, as in evaluations before 2026-12-02)")
    ap.add_argument("--run-name", default="default", help="folder under outputs/evaluate/")
    args = ap.parse_args(argv)
    if args.episodes < 2 or args.num_envs < 1:
        ap.error("--episodes must be >= 2 and --num-envs >= 1")
    torch.set_num_threads(1)  # leave the cores to the env workers
    try:
        results = evaluate_checkpoints(args.checkpoints, args.episodes, args.num_envs, args.seed,
                                       args.inference_steps, args.backend, args.max_episode_steps, args.act_horizon,
                                       args.noisy, fresh_scene=False if args.reuse_scene else None,
                                       steps=args.steps, samplers=args.sampler, zero_x0=args.zero_x0)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    run_path = run_dir("evaluate", args.run_name)
    command = "python -m flowlib.evaluate " + shlex.join(sys.argv[1:] if argv is None else argv)
    source = {**provenance(command), "checkpoints": [shown(Path(p)) for p in args.checkpoints]}
    rows = write_report(run_path, results, args.seed, source)
    flags = [k for k in rows[0] if k.endswith("_once")]
    print(f"{'policy':<40} {'success':>14} {'vs first (paired)':>20}" + "".join(f" {k:>20}" for k in flags))
    for r in rows:
        print(f"{r['policy']:<40} {r['success']:>7.3f} ± {r['se']:.3f} {r['diff']:>+11.3f} ± {r['diff_se']:.3f}"
              + "".join(f" {r[k]:>20.3f}" for k in flags))
    print(f"-> {run_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
