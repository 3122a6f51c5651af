"""Measurements of a stage-3 agent in the loop: the policy's share of an env step, and peak memory."""
from __future__ import annotations

import resource
import time

import torch

from flowlib.envs.maniskill import make_env
from flowlib.envs.smdp import ChunkRunner
from flowlib.methods import fql
from flowlib.methods.reinflow import collect
from flowlib.methods.residual_step import StepCollector, StepResidualAgent
from flowlib.methods.residual_td3 import replay_buffer


def peak_memory_mb() -> float:
    """Peak GPU memory (CUDA) or peak resident memory of this process (CPU), in MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _synchronizer(device):
    """A function that waits for ``device``'s queued kernels (CUDA), or does nothing (CPU)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def overhead(agent, env, decisions: int = 8, seed: int = 0) -> dict[str, float]:
    """Time per env step of the raw simulator (random actions) vs of the policy's share in the loop (a chunk-level
    agent's ``reinflow.collect``: noisy chain sampling, values, bookkeeping; a per-step residual's
    ``StepCollector``: the base chunks and a correction per env step; FQL's ``collect``), from ``decisions`` chunk decisions of each."""
    N, Ta = env.num_envs, agent.act_horizon
    steps = decisions * Ta * N
    sync = _synchronizer(env.device)  # CUDA runs asynchronously: a clock read after a launch times the launch alone
    env.reset(seed=seed)
    raw = 0.0
    for i in range(decisions * Ta):
        action = torch.rand(N, env.spec.action_dim, device=env.device) * 2 - 1
        sync()
        t0 = time.time()
        _, _, term, trunc, _ = env.step(action)
        sync()
        raw += time.time() - t0
        if (term | trunc).any():  # past the time limit: new episodes (not timed)
            env.reset(seed=seed + i + 1)
    raw /= steps
    runner = ChunkRunner(env, agent.obs_horizon, 0.99, first_seed=seed)
    sync()
    t0 = time.time()
    if isinstance(agent, StepResidualAgent):
        policy_time = StepCollector(agent, runner, torch.Generator().manual_seed(seed)).collect(
            replay_buffer(agent, steps), decisions * Ta)
    elif isinstance(agent, fql.FQLAgent):  # the one-step policy's collect
        policy_time = fql.collect(agent, runner, fql.replay_buffer(agent, decisions * N), decisions,
                                  torch.Generator().manual_seed(seed))
    else:
        policy_time = collect(agent, runner, decisions, torch.Generator().manual_seed(seed)).policy_time
    sync()
    total = time.time() - t0
    return {"num_envs": N, "raw_step_ms": 1e3 * raw, "policy_ms_per_env_step": 1e3 * policy_time / steps,
            "overhead_fraction": (policy_time / steps) / raw, "loop_env_steps_per_s": steps / total}


def overhead_table(agent, cfg, **env_kwargs) -> list[dict]:
    """``overhead`` of ``agent`` at each of ``cfg.bench_num_envs`` (fresh envs of ``cfg.env_id``, made with
    ``env_kwargs``: a visual policy's camera, ``flowlib.envs.visual.policy_env_kwargs``; episodes from ``cfg.eval_seed``),
    with the backend and the peak memory so far: a notebook's benchmark table."""
    rows = []
    for n in cfg.bench_num_envs:
        with make_env(cfg.env_id, n, max_episode_steps=cfg.max_episode_steps, backend=cfg.backend,
                      **env_kwargs) as env:
            rows.append({**overhead(agent, env, cfg.bench_decisions, seed=cfg.eval_seed), "backend": env.backend,
                         "peak_memory_mb": peak_memory_mb()})
    return rows
