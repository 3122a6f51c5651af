"""The two learner families of stage 3, behind one protocol that ``flowlib.rl.loop.train`` drives.

A learner owns the optimisers and whatever data outlives an iteration, and is built from callables its method
gives it (``flowlib.methods.stage3`` registers which):

    build_optimizers()                  actor_opt, critic_opt
    env_steps_per_iteration(num_envs)   the simulator steps of one collect
    start(runner, generator)            before the first iteration (and after a resume)
    collect() -> (steps_before, data, policy_time)
    update(data, train_policy) -> dict  the log row's update statistics
    state() / load_state(ckpt, path)    what the checkpoint holds beyond weights and optimisers

``PPOLearner``: on-policy (Schulman et al. 2017), a ``RolloutBuffer`` per iteration, advantages by
``flowlib.rl.ppo``'s estimators, ``ppo_update`` on it, then it is dropped.  ``ReplayLearner``: off-policy, every
transition kept in a ``ReplayBuffer`` and ``replay_updates_per_decision`` gradient steps per new decision (SAC,
TD3: their update steps live with their methods).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from flowlib.flows.distributions import LOG_2PI
from flowlib.infra.guards import require_finite
from flowlib.rl.advantages import RunningRewardScaler
from flowlib.rl.buffers import ReplayBuffer, RolloutBuffer
from flowlib.rl.loop import on_all_cores
from flowlib.rl.ppo import explained_variance, ppo_update


def twin_q_step(q: torch.Tensor, y: torch.Tensor, critic_opt, params, max_grad_norm: float,
                where: str) -> dict[str, float]:
    """One gradient step of twin critics: ``q [2, B]`` (``Q_1, Q_2`` of the batch, with gradients) regressed on the
    target ``y [B]``, ``L = sum_j mean_B (Q_j - y)^2`` (clipped double-Q's critic loss, Fujimoto et al. 2018, Eq. 10
    per net), its gradient over ``params`` clipped to ``max_grad_norm`` (a NaN / inf norm stops the run, naming
    ``where``).  Returns the log row's ``value_loss`` (per net), ``q`` and ``target``.  SAC, TD3 and FQL share it."""
    q_loss = (q - y).pow(2).mean(1).sum()
    critic_opt.zero_grad(set_to_none=True)
    q_loss.backward()
    require_finite(nn.utils.clip_grad_norm_(params, max_grad_norm), "the twin Q's gradient norm", where,
                   "lower critic_lr, or check the rewards for NaN")
    critic_opt.step()
    return {"value_loss": q_loss.item() / 2, "q": q.mean().item(), "target": y.mean().item()}


def decisions_per_iteration(cfg, act_horizon: int) -> int:
    """Chunk decisions per env per iteration: ``rollout_steps``, or one whole episode for GRPO."""
    return math.ceil(cfg.max_episode_steps / act_horizon) if cfg.advantage == "grpo" else cfg.rollout_steps


class PPOLearner:
    """PPO on what ``make_rollout(agent, runner, generator)() -> RolloutBuffer`` collects, scored by ``scorer``
    (the agent, or a view of it whose ``obs`` / ``chains`` are what its rollouts store), with optional
    ``regularisers`` of the policy in the loss (``ppo_update``; chain ReinFlow's ``W2Regulariser``, RFC's
    ``RFCRegulariser``).  A regulariser with a ``prepare(buf, advantages, batch)`` method adds what it reads to the
    flat batch before the update (RFC's mask)."""

    def __init__(self, agent, cfg, make_rollout: Callable, scorer=None, name: str = "PPO", regularisers=()):
        self.agent, self.cfg, self.make_rollout, self.name = agent, cfg, make_rollout, name
        self.regularisers = tuple(regularisers)  # penalties on the policy added to PPO's loss (``ppo_update``)
        self.scorer = agent if scorer is None else scorer
        self.reward_scaler = RunningRewardScaler() if cfg.reward_scaling else None

    def build_optimizers(self) -> None:
        # Adam rescales each coordinate by its own gradient noise; SGD keeps the gradient's direction
        optimizer = torch.optim.Adam if self.cfg.actor_optimizer == "adam" else torch.optim.SGD
        self.actor_opt = optimizer(self.agent.policy_parameters(), lr=self.cfg.actor_lr)
        self.critic_opt = torch.optim.Adam(self.agent.value_parameters(), lr=self.cfg.critic_lr)

    def env_steps_per_iteration(self, num_envs: int) -> int:
        """Simulator steps of one iteration's rollout, every branch's included."""
        Ta = self.agent.act_horizon
        return decisions_per_iteration(self.cfg, Ta) * num_envs * Ta * self.cfg.branches

    def start(self, runner, generator: torch.Generator) -> None:
        self.runner, self.gen = runner, generator
        self.rollout = self.make_rollout(self.agent, runner, generator)

    def collect(self) -> tuple[int, RolloutBuffer, float]:
        runner, cfg = self.runner, self.cfg
        if cfg.advantage == "grpo":  # one episode per env; the envs of a group start from the same seed
            G, N = cfg.group_size, runner.env.num_envs
            runner.restart([runner.next_seed + i // G for i in range(N)])
            runner.next_seed += N // G
        steps_before = runner.env_steps
        buf = self.rollout()
        return steps_before, buf, buf.policy_time

    def update(self, buf: RolloutBuffer, train_policy: bool) -> dict[str, float]:
        if self.reward_scaler is not None:  # the values then learn returns in units of the return's running std
            buf.rewards = self.reward_scaler(buf.rewards, buf.discounts, buf.ends)
        advantages, returns = buf.advantages(self.cfg)
        if self.cfg.flip_advantages:  # the control: the same update along the opposite of the estimated gradient
            advantages = -advantages
        batch = buf.flat(advantages, returns)
        for reg in self.regularisers:
            if hasattr(reg, "prepare"):
                reg.prepare(buf, advantages, batch)
        stats = ppo_update(self.scorer, batch, self.actor_opt, self.critic_opt, self.cfg,
                           train_policy=train_policy, generator=self.gen, regularisers=self.regularisers)
        live = buf.weights > 0
        stats["explained_variance"] = explained_variance(buf.values[live], returns[live])
        if "entropy" in stats:  # geometric-mean noise std from the Gaussian entropy
            stats["noise_std"] = math.exp(stats["entropy"] - 0.5 * (1 + LOG_2PI))
        if self.reward_scaler is not None:
            stats["reward_scale"] = self.reward_scaler.scale
        for reg in self.regularisers:
            stats |= reg.log() if hasattr(reg, "log") else {}
        return stats

    def state(self) -> dict:
        return {"reward_scaler": self.reward_scaler.state_dict()} if self.reward_scaler is not None else {}

    def load_state(self, ckpt: dict, path) -> None:
        if self.reward_scaler is not None and "reward_scaler" in ckpt:
            self.reward_scaler.load_state_dict(ckpt["reward_scaler"])


class ReplayLearner:
    """Off-policy actor-critic from a replay: ``make_collect(runner, generator)`` gives the callable that adds an
    iteration's transitions to the buffer and returns the policy's share of the wall time;
    ``update_step(learner, batch, train_policy, i)`` is the method's ``i``-th gradient step of the iteration; ``optimizers(agent, cfg)`` builds the two optimisers;
    ``decisions(num_envs)`` counts the decisions one iteration stores (a chunk, or an env step for a per-step
    residual); ``before_update()`` and ``after_update()`` (a dict for the log row) are optional hooks."""

    def __init__(self, agent, cfg, buffer: ReplayBuffer, make_collect: Callable, update_step: Callable,
                 optimizers: Callable, decisions: Callable, name: str, before_update: Callable | None = None,
                 after_update: Callable | None = None):
        self.agent, self.cfg, self.buffer, self.name = agent, cfg, buffer, name
        self._make_collect, self._update_step, self._optimizers = make_collect, update_step, optimizers
        self._decisions = decisions
        self._before, self._after = before_update, after_update

    def build_optimizers(self) -> None:
        self.actor_opt, self.critic_opt = self._optimizers(self.agent, self.cfg)

    def env_steps_per_iteration(self, num_envs: int) -> int:
        return self.cfg.rollout_steps * num_envs * self.agent.act_horizon

    def start(self, runner, generator: torch.Generator) -> None:
        self.runner, self.gen = runner, generator
        self._collect = self._make_collect(runner, generator)
        self.updates = max(1, round(self.cfg.replay_updates_per_decision * self._decisions(runner.env.num_envs)))

    def collect(self) -> tuple[int, None, float]:
        steps_before = self.runner.env_steps
        return steps_before, None, self._collect(self.buffer)

    def update(self, _, train_policy: bool) -> dict[str, float]:
        if self._before is not None:
            self._before(self)
        B, buffer = self.cfg.replay_batch_size, self.buffer
        stats = on_all_cores(lambda i: self._update_step(self, buffer.sample(B, self.gen), train_policy, i),
                             self.updates if len(buffer) >= B else 0)
        row = {"updates": len(stats), "buffer": len(buffer),
               **{k: float(np.mean([s[k] for s in stats if k in s])) for k in sorted({k for s in stats for k in s})}}
        return {**row, **(self._after(self) if self._after is not None else {})}

    def state(self) -> dict:
        return {"replay": self.buffer.state_dict()}

    def load_state(self, ckpt: dict, path) -> None:
        if "replay" not in ckpt:
            raise ValueError(f"{path} holds no replay buffer, so it is not a learner {self.cfg.learner!r} run: use "
                             "another run_name or resume=False")
        self.buffer.load_state_dict(ckpt["replay"])
