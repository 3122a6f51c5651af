"""Scoring a chunk policy on held-out episodes: ``evaluate``, the rollouts every stage reports (``bc.evaluate``).

Any ``chunk_policy.ChunkPolicy`` runs here: stage 1's ``FlowPolicy``, a stage-2 policy, a stage-3 agent (a per-step residual
closes the loop through ``correct_step``).  Each episode's env seed and policy noise are its own, so its result does
not depend on how the episodes are batched.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import torch

from flowlib.envs.data import Episode
from flowlib.infra import progress


@torch.no_grad()
def evaluate(policy, env, num_episodes: int, num_inference_steps: int, seed: int = 0,
             frame_every: int = 0, action_noise_std: float = 0.0, record: bool = False,
             zero_x0: bool = False) -> dict[str, Any]:
    """Roll out the ODE policy for ``num_episodes`` episodes (batches of ``env.num_envs``).

    ManiSkill's conventions: termination ignored, each episode runs ``env.max_episode_steps``
    steps; ``success_once`` = success at any step, ``success_at_end`` = at the last step.  Episode
    ``i`` uses env seed ``seed + i``, and its policy noise (each chain's ``x_0``, the action noise) comes
    from a generator seeded with ``seed + i`` too: an episode's result does not depend on how episodes
    are batched (``env.num_envs``), so CPU and GPU runs evaluate the same episodes (checked: a stage-3
    checkpoint's 200 episodes at 8 and at 4 envs agree one by one; that needs ``envs.clear_grasp_at_reset``).
    On ``physx_cpu`` it also needs an env made with ``fresh_scene=True``, or PhysX's contact state from the
    worker's earlier episodes can change an episode that grips the cube (``flowlib.envs``).
    ``action_noise_std > 0`` adds Gaussian exploration noise to the executed actions (clipped to
    the action box [-1, 1]).  ``record=True`` also returns the rollouts as ``flowlib.envs.data.Episode``
    (dense rewards, success; ``terminated`` = success as in ManiSkill's PickCube; the last step truncated).
    ``flags_once`` / ``per_episode_flags_once``: how often each of the env's other evaluation flags
    (``env.task_flags``; for PickCube ``is_grasped``, ``is_obj_placed``, ``is_robot_static``) was true at
    some step of an episode: where the episodes that fail stop on the way to success.  A policy with a
    ``closed_loop`` (``flowlib.methods.residual_step``) has each executed action corrected by ``correct_step`` from the
    current observation window before it runs (``ChunkPolicy``).  ``zero_x0`` starts every chunk's denoising from
    ``x_0 = 0``, the mode of its noise (DSRL's start), instead of a draw: the policy then acts as one map from
    observations to chunks (a DDPM's ancestral chain still draws its step noise, from that ``x_0``).
    """
    policy.eval()
    device = next(policy.parameters()).device
    correct = policy.correct_step if policy.closed_loop else None  # a per-step residual closes the loop
    once, at_end, returns, frames, episodes = [], [], [], [], []
    flags_once: dict[str, list[bool]] = {}
    t0, steps, policy_time = time.time(), 0, 0.0
    bar = progress.bar(num_episodes, "evaluating", unit="episode", leave=False)
    for first in range(0, num_episodes, env.num_envs):
        seeds = list(range(seed + first, seed + first + env.num_envs))
        obs = env.reset(seed=seeds)  # a list: physx_cuda too seeds env i with seeds[i] (an int seeds only env 0)
        gens = [torch.Generator().manual_seed(s) for s in seeds]  # the policy noise of each episode
        history = deque([obs] * policy.obs_horizon, maxlen=policy.obs_horizon)
        trace = {"obs": [obs.cpu()], "actions": [], "rewards": [], "success": []}
        ep_once = torch.zeros(env.num_envs, dtype=torch.bool)
        ep_return = torch.zeros(env.num_envs)
        ep_flags: dict[str, torch.Tensor] = {}  # name -> [N], true at some step so far
        t = 0
        while t < env.max_episode_steps:
            tp = time.time()
            window = torch.stack(list(history), dim=1).to(device)  # [N, To, O]
            x0 = _per_episode_randn(gens, (policy.pred_horizon, policy.action_dim))  # [N, H, A]
            if zero_x0:
                x0 = torch.zeros_like(x0)  # drawn all the same, so the action noise below is the same stream
            actions = policy.act(window, num_inference_steps, x0=x0).to(env.device)  # [N, Ta, A]
            if action_noise_std > 0:
                noise = _per_episode_randn(gens, actions.shape[1:]).to(env.device)
                actions = (actions + action_noise_std * noise).clamp(-1, 1)
            policy_time += time.time() - tp
            for a in actions.unbind(1):
                if correct is not None:
                    tp = time.time()
                    a = correct(torch.stack(list(history), dim=1).to(device), a.to(device)).to(env.device)
                    policy_time += time.time() - tp
                obs, reward, _, truncated, success = env.step(a)
                history.append(obs)
                ep_once |= success.cpu()
                ep_return += reward.cpu()
                for name, flag in getattr(env, "task_flags", {}).items():
                    ep_flags[name] = ep_flags.get(name, False) | flag.cpu()
                t += 1
                steps += env.num_envs
                if record:
                    for key, value in (("obs", obs), ("actions", a), ("rewards", reward), ("success", success)):
                        trace[key].append(value.cpu())
                if frame_every and first == 0 and t % frame_every == 0:
                    frames.append(env.render()[0])
                if t >= env.max_episode_steps:
                    break
        n = min(env.num_envs, num_episodes - first)
        seeds = seeds[:n]
        once += ep_once[:n].tolist()
        at_end += success.cpu()[:n].tolist()
        returns += ep_return[:n].tolist()
        for name, flag in ep_flags.items():
            flags_once.setdefault(name, []).extend(flag[:n].tolist())
        if record:
            episodes += _episodes_from_trace(trace, seeds)
        bar.update(n)
    bar.close()
    wall = time.time() - t0
    out = {"success_once": float(np.mean(once)), "success_at_end": float(np.mean(at_end)),
           "return": float(np.mean(returns)), "episodes": len(once), "per_episode_success_once": once,
           "per_episode_return": returns,
           "flags_once": {name: float(np.mean(v)) for name, v in flags_once.items()},
           "per_episode_flags_once": flags_once,
           "env_steps_per_s": steps / wall, "policy_time_fraction": policy_time / wall, "frames": frames}
    if record:
        out["rollouts"] = episodes
    return out


@torch.no_grad()
def chunk_ms(policy, num_steps: int, batch: int = 1, min_time_s: float = 0.3) -> float:
    """Milliseconds ``policy.act`` takes per call on a batch of ``batch`` observation windows at ``num_steps`` denoising
    steps: the inference cost of one chunk (timed over at least ``min_time_s`` and 3 calls, after one warm-up)."""
    device = next(policy.parameters()).device
    window = torch.zeros(batch, policy.obs_horizon, policy.meta["obs_dim"], device=device)
    x0 = torch.zeros(batch, policy.pred_horizon, policy.action_dim)
    policy.act(window, num_steps, x0=x0)
    calls, t0 = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - t0 < min_time_s:
        policy.act(window, num_steps, x0=x0)
        calls += 1
    return 1000 * (time.perf_counter() - t0) / calls


def _per_episode_randn(generators: list[torch.Generator], shape) -> torch.Tensor:
    """``[N, *shape]`` standard normals, row ``i`` drawn from ``generators[i]``."""
    return torch.stack([torch.randn(*shape, generator=g) for g in generators])


def _episodes_from_trace(trace: dict[str, list[torch.Tensor]], seeds: list[int]) -> list[Episode]:
    obs = torch.stack(trace["obs"], 1).numpy()           # [N, T+1, O]
    actions = torch.stack(trace["actions"], 1).numpy()   # [N, T, A]
    rewards = torch.stack(trace["rewards"], 1).numpy()   # [N, T]
    success = torch.stack(trace["success"], 1).numpy()   # [N, T]
    T = actions.shape[1]
    truncated = np.zeros(T, dtype=bool)
    truncated[-1] = True
    return [Episode(obs[i], actions[i], rewards[i].astype(np.float32), success[i].astype(bool), success[i].astype(bool),
                    truncated.copy(), seed=s) for i, s in enumerate(seeds)]
