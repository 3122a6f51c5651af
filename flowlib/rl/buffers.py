"""The data of one stage-3 iteration: on-policy rollouts of chunk decisions and an off-policy replay.

``RolloutBuffer`` holds one PPO iteration's decisions, time-major ``[T, N, ...]``, and turns them into advantages
and value targets with the estimators of ``flowlib.rl.advantages`` (GAE, Monte-Carlo, n-step, GRPO, branch).
``ReplayBuffer`` is a ring of transitions for the off-policy learners (SAC over ``x_0``, TD3 on a per-step residual).
Neither knows which stage-3 method filled it: a decision's "chain" is whatever the method scores (a denoising chain
``[K+1, H, A]``; a steer's one draw and its chunk ``[2, H, A]``, ``flowlib.methods.steering``; or a per-step residual
``[1, A]``), with one stochastic flag and step log-prob per scored step (``K``, or 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flowlib.rl.advantages import branch_advantages, gae, grpo_advantages, mc_returns, nstep_returns


@dataclass
class RolloutBuffer:
    """Chunk-level transitions of one PPO iteration, time-major ``[T, N, ...]``."""

    obs: torch.Tensor             # [T, N, To, O]   raw observation windows
    chains: torch.Tensor          # [T, N, K+1, H, A]  (a steer's decision: [T, N, 2, H, A], its K is 1)
    stochastic: torch.Tensor      # [T, N, K]  bool: which denoising steps carried noise
    step_log_probs: torch.Tensor  # [T, N, K]
    log_probs: torch.Tensor       # [T, N]    joint
    values: torch.Tensor          # [T, N]
    rewards: torch.Tensor         # [T, N]  sum_{k<tau} gamma^k r
    discounts: torch.Tensor       # [T, N]  gamma^tau
    next_values: torch.Tensor     # [T, N]  V(s_{t+tau})
    terminal: torch.Tensor        # [T, N]  bool
    ends: torch.Tensor            # [T, N]  bool (terminated or truncated)
    weights: torch.Tensor         # [T, N]  1 = a live decision, 0 = an env idling after its episode (GRPO)
    policy_time: float = 0.0      # seconds of the rollout spent in the policy (chain, values)
    states: torch.Tensor | None = None       # [T, N, C]  what an asymmetric V reads beside obs (flowlib.rl.asymmetric)
    next_states: torch.Tensor | None = None  # [T, N, P]  chain PPO's: the simulator state after the decision

    def flat(self, advantages: torch.Tensor, returns: torch.Tensor) -> dict[str, torch.Tensor]:
        n = self.rewards.numel()
        return {"obs": self.obs.reshape(n, *self.obs.shape[2:]), "chains": self.chains.reshape(n, *self.chains.shape[2:]),
                "stochastic": self.stochastic.reshape(n, -1), "step_log_probs": self.step_log_probs.reshape(n, -1),
                "log_probs": self.log_probs.reshape(n), "values": self.values.reshape(n), "weights": self.weights.reshape(n),
                "advantages": advantages.reshape(n), "returns": returns.reshape(n),
                **({"states": self.states.reshape(n, -1)} if self.states is not None else {})}

    def advantages(self, cfg) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, returns)`` ``[T, N]`` by ``cfg.advantage`` (``flowlib.rl.advantages``); returns are the value targets."""
        args = (self.rewards, self.next_values, self.discounts, self.terminal, self.ends)
        if cfg.advantage == "gae":
            return gae(self.rewards, self.values, self.next_values, self.discounts, self.terminal, self.ends,
                       cfg.gae_lambda)
        if cfg.advantage == "branch":  # [T, M*N]: Q_m = R_m + gamma^tau V(s'_m), leave-one-out over the M branches
            q = self.rewards + self.discounts * (~self.terminal) * self.next_values
            T, M = q.shape[0], cfg.branches
            adv = branch_advantages(q.reshape(T, M, -1).transpose(0, 1)).transpose(0, 1).reshape(T, -1)
            return adv, q
        if cfg.advantage == "nstep":
            returns = nstep_returns(*args, cfg.n_step)
            return returns - self.values, returns
        returns = mc_returns(*args)
        if cfg.advantage == "mc":
            return returns - self.values, returns
        # grpo: every env ran one episode from its group's seed; score = its discounted return
        before = torch.cumprod(torch.cat([torch.ones_like(self.discounts[:1]), self.discounts[:-1]]), 0)
        scores = (before * self.rewards * self.weights).sum(0)                               # [N]
        groups = torch.arange(scores.shape[0]) // cfg.group_size
        return grpo_advantages(scores, groups)[None].expand_as(self.rewards).clone(), returns


class ReplayBuffer:
    """A ring of the last ``capacity`` chunk decisions: ``obs [To, O]``, latent ``w [H, A]``, the SMDP reward
    ``R``, the bootstrap factor ``gamma^tau (1 - terminal)`` and ``next_obs [To, O]`` (for an episode that ended,
    its last window, which a termination does not bootstrap from and a truncation does); ``extra`` names more
    fields and their shapes (``flowlib.methods.residual_step`` stores the base actions)."""

    def __init__(self, capacity: int, obs_shape: tuple[int, ...], latent_shape: tuple[int, ...],
                 **extra: tuple[int, ...]):
        shapes = {"obs": obs_shape, "latent": latent_shape, "reward": (), "bootstrap": (), "next_obs": obs_shape,
                  **extra}
        self.fields = tuple(shapes)
        self.data = {k: torch.zeros(capacity, *shapes[k]) for k in self.fields}
        self.capacity, self.ptr, self.size = capacity, 0, 0

    def __len__(self) -> int:
        return self.size

    def add(self, **rows: torch.Tensor) -> None:
        """Append ``[N, ...]`` rows of every field."""
        if set(rows) != set(self.fields):
            raise ValueError(f"add needs exactly the fields {self.fields}, got {sorted(rows)}")
        n = len(rows["obs"])
        idx = (self.ptr + torch.arange(n)) % self.capacity
        for k in self.fields:
            self.data[k][idx] = rows[k].detach().to(self.data[k].dtype).cpu()
        self.ptr, self.size = (self.ptr + n) % self.capacity, min(self.size + n, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        if self.size == 0:
            raise ValueError("the replay buffer is empty: collect decisions before sampling")
        idx = torch.randint(self.size, (batch_size,), generator=generator)
        return {k: v[idx] for k, v in self.data.items()}

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "ptr": self.ptr, "size": self.size,
                **{k: v[:self.size].clone() for k, v in self.data.items()}}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in self.fields if k not in state]
        if missing:
            raise ValueError(f"the saved replay buffer lacks the fields {missing}: it was written by another learner")
        if state["capacity"] != self.capacity or state["obs"].shape[1:] != self.data["obs"].shape[1:]:
            raise ValueError(f"the saved replay buffer (capacity {state['capacity']}, obs {tuple(state['obs'].shape[1:])})"
                             f" does not fit this one (capacity {self.capacity}, obs {tuple(self.data['obs'].shape[1:])})")
        self.ptr, self.size = state["ptr"], state["size"]
        for k in self.fields:
            self.data[k][:self.size] = state[k]


class NStepReturns:
    """Turns the collector's one-step transitions into ``n``-step ones (Sutton & Barto 2018, Eq. 7.1; as in D4PG and
    Rainbow, without an off-policy correction), so that a reward reaches the critic's target ``n`` steps earlier
    than through ``n`` bootstraps::

        R = sum_{k<m} (prod_{j<k} g_j) r_{t+k},   bootstrap = prod_{j<m} g_j,   s' = s_{t+m}

    ``g_j`` = ``gamma (1 - terminal)`` of step ``t + j``, ``m = n``, or fewer where the episode ends inside the
    window (a termination zeroes the bootstrap, a truncation keeps ``gamma^m`` and bootstraps from the last window)
    or where ``flush`` cuts it.  All envs step together, so a window is the last ``n`` steps' ``[N, ...]`` rows:
    ``push`` returns the oldest step's ``n``-step rows once ``n`` steps are pending, ``flush`` all pending ones
    (the rollout was broken off: the runner restarted its episodes).  ``n = 1`` passes each step through."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"td3_n_step must be >= 1, got {n}")
        self.n, self.pending = n, []

    def push(self, **step: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """``step``: one env step's rows of every replay field plus ``end [N]`` (the episode ended there)."""
        if self.n == 1:  # the default, on the rollout's hot path: nothing to sum (0.2 ms a step saved)
            step.pop("end")
            return [step]
        self.pending.append(step)
        return [self._pop()] if len(self.pending) == self.n else []

    def flush(self) -> list[dict[str, torch.Tensor]]:
        return [self._pop() for _ in range(len(self.pending))]

    def _pop(self) -> dict[str, torch.Tensor]:
        steps, first = self.pending, self.pending[0]
        r = torch.stack([s["reward"] for s in steps])                                   # [L, N]
        g = torch.stack([s["bootstrap"] for s in steps])                                # [L, N]
        end = torch.stack([s["end"] for s in steps]).long()                             # [L, N]
        before = torch.cumprod(torch.cat([torch.ones_like(g[:1]), g[:-1]]), 0)          # prod_{j<k} g_j
        inside = (end.cumsum(0) - end) == 0                                             # no end before step k
        last = torch.where(end.any(0), end.argmax(0), len(steps) - 1)                   # [N]: step m - 1
        envs = torch.arange(len(last))
        out = {k: v for k, v in first.items() if k in ("obs", "latent", "base", "priv")}
        out["reward"] = (inside * before * r).sum(0)
        out["bootstrap"] = (before * g)[last, envs]
        for k in [k for k in first if k.startswith("next_")]:  # next_obs, next_base (and next_priv)
            out[k] = torch.stack([s[k] for s in steps])[last, envs]
        self.pending = steps[1:]
        return out
