"""Returns and advantages over chunk decisions, time-major ``[T, N]``, with semi-MDP discounts ``gamma^tau``: what
PPO (``flowlib.rl.ppo``) follows, as ``flowlib.rl.buffers.RolloutBuffer.advantages`` picks them by ``advantage``.

- ``gae``: generalised advantage estimation (Schulman et al. 2016, Eq. 16);
- ``mc``: Monte-Carlo returns to the episode end (bootstrapped at a truncation and at the rollout's end)
  minus ``V``; equals GAE at ``lambda = 1``;
- ``nstep``: ``n``-decision returns bootstrapped with ``V(s_{t+n})`` minus ``V``; ``n = 1`` is TD(0);
- ``grpo``: group-relative advantages (Shao et al. 2024, DeepSeekMath Eq. 3, outcome supervision): the
  episodes of a group start from the same env seed, and an episode's advantage is its return minus the
  group mean, over the group std.  No critic is needed.
- ``branch``: several chains tried from one saved env state (the "vine" of Schulman et al. 2015, TRPO
  Sec. 5.2): each branch's one-decision return ``Q_m = R_m + gamma^tau V(s'_m)`` minus the mean of the
  other branches' (the leave-one-out baseline of Kool et al. 2019, "Buy 4 REINFORCE samples").  What all
  branches share cancels: ``V(s)`` and its error, the episode's past and (by the envs' determinism) its physics.

``RunningRewardScaler`` divides the rewards by a running std of the return first (``reward_scaling``).
"""
from __future__ import annotations

import math

import torch

ESTIMATORS = ("gae", "mc", "nstep", "grpo", "branch")


class RunningRewardScaler:
    """Rewards divided by a running standard deviation of the discounted return, then clipped to ``+-clip``: the
    ``RunningRewardScaler`` of DPPO and ReinFlow (after OpenAI baselines' ``VecNormalize``).

    Per env (column), the return so far runs over decisions, ``G_t = R_t + gamma^tau_{t-1} G_{t-1}``, restarting at
    0 after an episode ends; every ``G_t`` of a rollout updates a running mean and variance (the parallel update of
    Chan et al. 1979, from a prior of count 1e-4), and the rewards come back as ``R_t / sqrt(Var[G] + eps)``. It
    changes the scale of the values, not the sign of an advantage; ``state_dict`` keeps it across a resume.
    """

    def __init__(self, clip: float = 10.0, eps: float = 1e-8):
        self.clip, self.eps = clip, eps
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4
        self.returns: torch.Tensor | None = None  # [N] the running G of each env, float64

    def __call__(self, rewards: torch.Tensor, discounts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """``rewards``, ``discounts`` (``gamma^tau``), ``ends``: ``[T, N]`` of one rollout -> the scaled rewards."""
        T, N = rewards.shape
        if self.returns is None or self.returns.shape != (N,):
            self.returns = torch.zeros(N, dtype=torch.float64)
        G = torch.empty(T, N, dtype=torch.float64)
        for t in range(T):
            self.returns = rewards[t].double() + self.returns
            G[t] = self.returns
            self.returns = torch.where(ends[t].bool(), 0.0, discounts[t].double() * self.returns)
        self.update(G.flatten())
        return (rewards / math.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip)

    def update(self, x: torch.Tensor) -> None:
        n, mean, var = x.numel(), float(x.mean()), float(x.var(unbiased=False))
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.var = (self.var * self.count + var * n + delta ** 2 * self.count * n / total) / total
        self.count = total

    @property
    def scale(self) -> float:
        """The factor the rewards are multiplied by now, ``1 / sqrt(Var[G] + eps)``."""
        return 1.0 / math.sqrt(self.var + self.eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count, "returns": self.returns}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count, self.returns = state["mean"], state["var"], state["count"], state["returns"]


# --------------------------------------------------------------------------- advantages


def gae(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor, discounts: torch.Tensor,
        terminal: torch.Tensor, ends: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over chunk decisions (Schulman et al. 2016, Eq. 16, SMDP form).

    All inputs ``[T, N]`` (time-major).  ``rewards``: in-chunk discounted sums ``R``; ``discounts``:
    ``gamma^tau``; ``next_values``: ``V(s_{t+tau})`` (for a truncated episode, of its last
    observation); ``terminal``: the episode terminated in this chunk (no bootstrap); ``ends``:
    the episode ended here (terminated or truncated: the recursion does not cross it).

        delta_t = R_t + gamma^tau_t (1 - terminal_t) V(s_{t+tau}) - V(s_t)
        A_t     = delta_t + gamma^tau_t lambda (1 - end_t) A_{t+1}

    Returns ``(advantages, returns = advantages + values)``.
    """
    T = rewards.shape[0]
    not_terminal, not_end = 1.0 - terminal.float(), 1.0 - ends.float()
    deltas = rewards + discounts * not_terminal * next_values - values
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in reversed(range(T)):
        last = deltas[t] + discounts[t] * lam * not_end[t] * last
        adv[t] = last
    return adv, adv + values


def mc_returns(rewards: torch.Tensor, next_values: torch.Tensor, discounts: torch.Tensor,
               terminal: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Discounted returns to the episode's end, ``[T, N]``::

        G_t = R_t + gamma^tau_t [(1 - end_t) G_{t+1} + end_t (1 - terminal_t) V(s_{t+tau})]

    with ``G_{T} := V(s_{T})`` at the rollout's cut (the last decision bootstraps like a truncation).
    """
    T = rewards.shape[0]
    not_terminal, end = 1.0 - terminal.float(), ends.float()
    out = torch.zeros_like(rewards)
    nxt = next_values[-1] * not_terminal[-1]
    for t in reversed(range(T)):
        boot = not_terminal[t] * next_values[t]
        follow = nxt if t < T - 1 else boot
        out[t] = rewards[t] + discounts[t] * ((1 - end[t]) * follow + end[t] * boot)
        nxt = out[t]
    return out


def nstep_returns(rewards: torch.Tensor, next_values: torch.Tensor, discounts: torch.Tensor,
                  terminal: torch.Tensor, ends: torch.Tensor, n: int) -> torch.Tensor:
    """``n``-decision returns ``G_t = sum_{i<m} D_{t,i} R_{t+i} + D_{t,m} (1 - terminal) V(s_{t+m})``, ``[T, N]``.

    ``D_{t,i}`` is the product of the first ``i`` discounts ``gamma^tau``; ``m <= n`` stops early at an
    episode's end (bootstrapping only after a truncation) or at the rollout's last decision.
    """
    if n < 1:
        raise ValueError(f"n_step must be >= 1, got {n}")
    T = rewards.shape[0]
    not_terminal, end = 1.0 - terminal.float(), ends.bool()
    out = torch.zeros_like(rewards)
    for t in range(T):
        acc, disc = torch.zeros_like(rewards[0]), torch.ones_like(rewards[0])
        open_ = torch.ones_like(end[0])  # the episode of the decision at t is still running
        for i in range(min(n, T - t)):
            j = t + i
            acc = acc + open_ * disc * rewards[j]
            disc_next = disc * discounts[j]
            stop = end[j] | (i == min(n, T - t) - 1)  # bootstrap here
            acc = acc + (open_ & stop) * disc_next * not_terminal[j] * next_values[j]
            open_ = open_ & ~stop
            disc = disc_next
        out[t] = acc
    return out


def branch_advantages(q: torch.Tensor) -> torch.Tensor:
    """Leave-one-out advantages over branches, ``A_m = Q_m - mean_{j != m} Q_j``; ``q [M, ...]`` with
    ``M >= 2`` branches from the same state (Kool et al. 2019's leave-one-out baseline).
    Unbiased: the baseline of branch ``m`` does not depend on branch ``m``'s action."""
    M = q.shape[0]
    if M < 2:
        raise ValueError(f"branch advantages need >= 2 branches per state, got {M}")
    return (q - (q.sum(0, keepdim=True) - q) / (M - 1))


def grpo_advantages(scores: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(score - mean_group) / (std_group + eps)`` per element; a group of one gets 0.  ``[E], [E] -> [E]``."""
    adv = torch.zeros_like(scores)
    for g in groups.unique():
        m = groups == g
        s = scores[m]
        adv[m] = 0.0 if s.numel() < 2 else (s - s.mean()) / (s.std() + eps)
    return adv
