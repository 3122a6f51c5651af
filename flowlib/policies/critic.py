"""Chunk-level critics for action-chunk policies (stage 2 offline, reusable by stage 3).

Semi-MDP transitions (Sutton, Precup & Singh 1999)
--------------------------------------------------
A policy that executes ``act_horizon = Ta`` actions per decision turns the MDP into a semi-MDP
over decision steps.  A chunk started at step ``c`` runs ``tau = min(Ta, T - c)`` steps (shorter
when the episode ends inside it) and gives::

    R      = sum_{k < tau} gamma^k r_{c+k}                      # discounted chunk reward
    Q(s_c, a_chunk) = R + gamma^tau * (1 - terminal) * V(s_{c+tau})   # SMDP Bellman target

``terminal`` is true only when the episode *terminated* inside the chunk (here: the task was
solved); a time-limit *truncation* is not termination, so it bootstraps from ``V(s_{c+tau})``.

Critics
-------
* ``IQLCritic`` (Kostrikov et al. 2022, IQL): ``V`` by expectile regression on the twin target
  ``Q`` (Eq. 5), twin ``Q`` by regression on ``R + gamma^tau (1 - terminal) V(s')`` (Eq. 6),
  Polyak-averaged target ``Q`` nets.  Advantage ``A = min_i Q_targ_i(s, a) - V(s)``.
* ``MCCritic``: ``V(s_c)`` regressed on the observed discounted return ``G_c`` (Monte Carlo);
  advantage ``A = G_c - V(s_c)``.  No bootstrapping, so truncated episodes under-count.

Both take the observation window ``[B, To, O]`` (and, for ``Q``, the executed chunk
``[B, Ta, A]``) in raw units and normalise them with the policy's normalisers.

Weights (AWR, Peng et al. 2019, Eq. 7): ``w = min(exp(beta * A), w_max)``, or batch-softmax
``w = B * softmax(beta * A)``; ``effective_sample_size`` tells whether ``beta`` is sane.  RFC's masks (the RLinf
notes; ``rfc_mask``: the episode succeeded, ``A > 0``, the top share by ``A``) pick samples instead of weighting
them; stage 3's RFC reflows on them online (``flowlib.methods.rfc``), notebook 02 offline (``mask_weights``).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from flowlib.envs.data import ChunkDataset, Episode, Normalizer
from flowlib.flows.nets import mlp
from flowlib.infra import progress
from flowlib.infra.guards import require_finite

REWARDS = ("sparse", "dense")


@dataclass
class ChunkTransitions:
    """One SMDP transition per decision step, in the order of ``ChunkDataset.index``."""

    obs: torch.Tensor        # [N, To, O]  raw observation window at the decision step c
    actions: torch.Tensor    # [N, Ta, A]  raw executed actions (rows past the episode end padded)
    reward: torch.Tensor     # [N]  R = sum_{k<tau} gamma^k r_{c+k}
    discount: torch.Tensor   # [N]  gamma^tau * (1 - terminal): the factor in front of V(s')
    next_obs: torch.Tensor   # [N, To, O]  window at c + tau
    terminal: torch.Tensor   # [N]  bool: the episode terminated inside the chunk
    tau: torch.Tensor        # [N]  steps the chunk ran
    mc_return: torch.Tensor  # [N]  G_c = sum_{k >= 0} gamma^k r_{c+k} to the episode's end
    episode: torch.Tensor    # [N]  episode index

    def __len__(self) -> int:
        return len(self.reward)

    def subset(self, mask: torch.Tensor) -> "ChunkTransitions":
        return ChunkTransitions(**{k: getattr(self, k)[mask] for k in self.__dataclass_fields__})


def truncate_at_success(ep: Episode) -> Episode:
    """Cut an episode after its first success and mark that step terminal (the task is solved).

    Episodes that never succeed are returned unchanged (they end by truncation).
    """
    hits = np.flatnonzero(ep.success)
    if len(hits) == 0:
        return ep
    k = int(hits[0])
    terminated = np.zeros(k + 1, dtype=bool)
    terminated[k] = True
    return Episode(ep.obs[:k + 2], ep.actions[:k + 1], ep.rewards[:k + 1], ep.success[:k + 1], terminated,
                   np.zeros(k + 1, dtype=bool), seed=ep.seed)


def cut_window_index(full: ChunkDataset, cut: ChunkDataset) -> torch.Tensor:
    """For every window of ``full`` (episodes as recorded) the index of its window in ``cut`` (the same episodes after
    ``truncate_at_success``), ``[N_full]``: the same window up to the cut, the cut episode's last window after it.

    So a per-window weight computed on the critic's cut data (an advantage, a mask) carries over to the flow's uncut
    windows: a window that decides after the first success is weighted as the decision at the success step.  An
    episode of ``T`` steps has ``T`` windows (``ChunkDataset``), window ``(e, s)`` at ``offset[e] + s + To - 1``.
    """
    if len(full.episodes) != len(cut.episodes) or full.obs_horizon != cut.obs_horizon:
        raise ValueError(f"full and cut must hold the same episodes with the same obs_horizon, got "
                         f"{len(full.episodes)} / {len(cut.episodes)} episodes, obs_horizon {full.obs_horizon} / "
                         f"{cut.obs_horizon}: build both from one episode list, cut with truncate_at_success")
    full_len = np.array([len(ep) for ep in full.episodes])
    cut_len = np.array([len(ep) for ep in cut.episodes])
    if (cut_len > full_len).any():
        e = int(np.flatnonzero(cut_len > full_len)[0])
        raise ValueError(f"episode {e} is longer cut ({cut_len[e]}) than uncut ({full_len[e]}): "
                         "pass the uncut dataset first, the cut one second")
    offset = np.concatenate([[0], np.cumsum(cut_len)[:-1]])
    e, s = np.asarray(full.index).T  # [N_full] each
    return torch.as_tensor(offset[e] + np.minimum(s + full.obs_horizon - 1, cut_len[e] - 1), dtype=torch.long)


def episode_rewards(ep: Episode, reward: str) -> np.ndarray:
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
    r = ep.sparse_rewards if reward == "sparse" else ep.rewards
    if not np.isfinite(r).all():
        raise ValueError("episode rewards contain NaN or inf: check the recorded data")
    return r


def chunk_transitions(dataset: ChunkDataset, act_horizon: int, gamma: float, reward: str = "sparse") -> ChunkTransitions:
    """SMDP transitions for every window of ``dataset`` (module docstring for the equations).

    Window ``(e, s)`` decides at step ``c = s + To - 1`` and executes
    ``actions[c : c + act_horizon]``, the rows the policy executes from its chunk.
    """
    To = dataset.obs_horizon
    if not 1 <= act_horizon <= dataset.pred_horizon - To + 1:
        raise ValueError(f"act_horizon={act_horizon} must be in [1, pred_horizon - obs_horizon + 1]")
    returns = []  # per episode: G_c for every c, by the backward recursion G_c = r_c + gamma G_{c+1}
    for ep in dataset.episodes:
        r = episode_rewards(ep, reward)
        g, acc = np.zeros(len(r), dtype=np.float64), 0.0
        for c in range(len(r) - 1, -1, -1):
            acc = r[c] + gamma * acc
            g[c] = acc
        returns.append(g)
    cols = {k: [] for k in ("obs", "actions", "reward", "discount", "next_obs", "terminal", "tau", "mc_return", "episode")}
    for e, s in dataset.index:
        ep = dataset.episodes[e]
        T, c = len(ep), s + To - 1
        tau = min(act_horizon, T - c)
        r = episode_rewards(ep, reward)[c:c + tau]
        terminal = bool(ep.terminated[c:c + tau].any())
        obs, chunk = dataset.window(e, s)
        cols["obs"].append(obs)
        cols["actions"].append(chunk[To - 1:To - 1 + act_horizon])
        cols["reward"].append(float(np.sum(r * gamma ** np.arange(tau))))
        cols["discount"].append(0.0 if terminal else gamma ** tau)
        cols["next_obs"].append(dataset.window(e, s + tau)[0])
        cols["terminal"].append(terminal)
        cols["tau"].append(tau)
        cols["mc_return"].append(returns[e][c])
        cols["episode"].append(e)
    as_t = lambda k, dt=torch.float32: torch.as_tensor(np.asarray(cols[k]), dtype=dt)  # noqa: E731
    return ChunkTransitions(as_t("obs"), as_t("actions"), as_t("reward"), as_t("discount"), as_t("next_obs"),
                            as_t("terminal", torch.bool), as_t("tau", torch.long), as_t("mc_return"),
                            as_t("episode", torch.long))


def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """``|tau - 1(u < 0)| u^2`` averaged, ``u = Q - V`` (IQL Eq. 5); equals MSE at ``tau = 0.5`` up to 1/2."""
    if not 0.0 < expectile < 1.0:
        raise ValueError(f"expectile must be in (0, 1), got {expectile}")
    weight = torch.where(diff < 0, 1.0 - expectile, expectile)
    return (weight * diff.pow(2)).mean()


def advantage_weights(adv: torch.Tensor, beta: float, max_weight: float = 20.0, kind: str = "exp") -> torch.Tensor:
    """AWR weights (Peng et al. 2019, Eq. 7): ``min(exp(beta A), w_max)`` or ``B softmax(beta A)``."""
    if not torch.isfinite(adv).all():
        raise ValueError("advantages contain NaN or inf: the critic diverged; lower critic_lr or check rewards")
    if kind == "exp":
        return torch.exp(beta * adv).clamp(max=max_weight)
    if kind == "softmax":
        return len(adv) * torch.softmax(beta * adv, dim=0)
    raise ValueError(f"weighting must be 'exp' or 'softmax', got {kind!r}")


def effective_sample_size(w: torch.Tensor) -> float:
    """Kish's effective sample size ``(sum w)^2 / sum w^2`` as a fraction of ``len(w)`` (1 = uniform)."""
    w = w.double()
    return float(w.sum() ** 2 / (w.pow(2).sum() * len(w)))


RFC_MASKS = ("success_only", "advantage_positive", "advantage_topk")


def rfc_mask(kind: str, advantages: torch.Tensor, success: torch.Tensor, weights: torch.Tensor,
             topk: float = 0.25) -> torch.Tensor:
    """The decisions RFC reflows on, ``[n]`` bool, among the live ones (``weights > 0``): see the module docstring.
    ``advantage_topk`` keeps ``ceil(topk * live)`` rows and every row tied with the last of them."""
    live = weights > 0
    if kind == "success_only":
        return success.bool() & live
    if kind == "advantage_positive":
        return (advantages > 0) & live
    if kind == "advantage_topk":
        n_live = int(live.sum())
        if n_live == 0:
            return live
        k = max(1, math.ceil(topk * n_live))
        cut = advantages[live].topk(k).values[-1]
        return (advantages >= cut) & live
    raise ValueError(f"rfc_mask must be one of {RFC_MASKS}, got {kind!r}")


def mask_weights(mask: torch.Tensor) -> torch.Tensor:
    """A mask (``rfc_mask``) as per-sample weights ``m / mean(m)``: ``bc.train``'s weighted loss ``mean(w l)`` is then,
    in expectation over its uniform batches, the mean loss over the kept samples alone (filtered BC, RFC offline)."""
    if not mask.any():
        raise ValueError("the mask keeps no sample: lower rfc_topk, or add data in which some episodes succeed")
    m = mask.float()
    return m / m.mean()


class ChunkCritic(nn.Module):
    """Shared plumbing: normalise inputs, flatten windows, MLP heads."""

    def __init__(self, obs_dim: int, action_dim: int, obs_horizon: int, act_horizon: int,
                 obs_normalizer: Normalizer, action_normalizer: Normalizer, hidden_dims: list[int]):
        super().__init__()
        self.dims = dict(obs_dim=obs_dim, action_dim=action_dim, obs_horizon=obs_horizon, act_horizon=act_horizon,
                         hidden_dims=list(hidden_dims))
        self.obs_normalizer = copy.deepcopy(obs_normalizer)
        self.action_normalizer = copy.deepcopy(action_normalizer)
        self.obs_in, self.act_in = obs_horizon * obs_dim, act_horizon * action_dim

    def _obs(self, obs: torch.Tensor) -> torch.Tensor:  # [B, To, O] -> [B, To * O]
        d = self.dims
        if obs.shape[1:] != (d["obs_horizon"], d["obs_dim"]):
            raise ValueError(f"obs must be [B, {d['obs_horizon']}, {d['obs_dim']}], got {tuple(obs.shape)}")
        return self.obs_normalizer.normalize(obs).flatten(1)

    def _act(self, actions: torch.Tensor) -> torch.Tensor:  # [B, Ta, A] -> [B, Ta * A]
        d = self.dims
        if actions.shape[1:] != (d["act_horizon"], d["action_dim"]):
            raise ValueError(f"actions must be [B, {d['act_horizon']}, {d['action_dim']}], got {tuple(actions.shape)}")
        return self.action_normalizer.normalize(actions).flatten(1)


class IQLCritic(ChunkCritic):
    """``V(s)`` and twin ``Q(s, a_chunk)`` trained by IQL on SMDP transitions (module docstring)."""

    kind = "iql"

    def __init__(self, *args, expectile: float = 0.7, polyak: float = 0.005, **kwargs):
        super().__init__(*args, **kwargs)
        h = self.dims["hidden_dims"]
        self.value_net = mlp([self.obs_in, *h, 1], act=nn.Mish)
        self.q_nets = nn.ModuleList(mlp([self.obs_in + self.act_in, *h, 1], act=nn.Mish) for _ in range(2))
        self.q_targets = copy.deepcopy(self.q_nets).requires_grad_(False)
        self.expectile, self.polyak = expectile, polyak

    def value(self, obs: torch.Tensor) -> torch.Tensor:  # [B, To, O] -> [B]
        return self.value_net(self._obs(obs)).squeeze(-1)

    def q_values(self, obs, actions, target: bool = False) -> torch.Tensor:  # -> [2, B]
        x = torch.cat([self._obs(obs), self._act(actions)], dim=-1)
        nets = self.q_targets if target else self.q_nets
        return torch.stack([q(x).squeeze(-1) for q in nets])

    def advantage(self, obs, actions, **_) -> torch.Tensor:  # [B]
        return self.q_values(obs, actions, target=True).min(0).values - self.value(obs)

    def losses(self, batch: ChunkTransitions) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            q_min = self.q_values(batch.obs, batch.actions, target=True).min(0).values
            q_target = batch.reward + batch.discount * self.value(batch.next_obs)  # SMDP Bellman target
        value_loss = expectile_loss(q_min - self.value(batch.obs), self.expectile)
        q_loss = sum(F.mse_loss(q, q_target) for q in self.q_values(batch.obs, batch.actions))
        return {"value_loss": value_loss, "q_loss": q_loss}

    @torch.no_grad()
    def after_step(self) -> None:
        for p, p_targ in zip(self.q_nets.parameters(), self.q_targets.parameters()):
            p_targ.lerp_(p, self.polyak)


class MCCritic(ChunkCritic):
    """``V(s_c)`` regressed on the Monte-Carlo discounted return ``G_c``; ``A = G_c - V(s_c)``."""

    kind = "mc"

    def __init__(self, *args, **kwargs):
        kwargs.pop("expectile", None), kwargs.pop("polyak", None)
        super().__init__(*args, **kwargs)
        self.value_net = mlp([self.obs_in, *self.dims["hidden_dims"], 1], act=nn.Mish)

    def value(self, obs):
        return self.value_net(self._obs(obs)).squeeze(-1)

    def advantage(self, obs, actions, mc_return=None) -> torch.Tensor:
        if mc_return is None:
            raise ValueError("the Monte-Carlo critic needs the observed returns (mc_return) for its advantages")
        return mc_return - self.value(obs)

    def losses(self, batch: ChunkTransitions) -> dict[str, torch.Tensor]:
        return {"value_loss": F.mse_loss(self.value(batch.obs), batch.mc_return)}

    def after_step(self) -> None:
        pass


CRITICS = {"iql": IQLCritic, "mc": MCCritic}


def build_critic(kind: str, meta: dict, obs_normalizer: Normalizer, action_normalizer: Normalizer,
                 hidden_dims: list[int], expectile: float = 0.7, polyak: float = 0.005) -> ChunkCritic:
    """A critic for a policy with checkpoint metadata ``meta`` (dims and horizons)."""
    if kind not in CRITICS:
        raise ValueError(f"critic must be one of {sorted(CRITICS)}, got {kind!r}")
    return CRITICS[kind](meta["obs_dim"], meta["action_dim"], meta["obs_horizon"], meta["act_horizon"],
                         obs_normalizer, action_normalizer, hidden_dims=hidden_dims, expectile=expectile, polyak=polyak)


def train_critic(critic: ChunkCritic, data: ChunkTransitions, steps: int, batch_size: int = 256, lr: float = 3e-4,
                 seed: int = 0, tracker=None, log_every: int = 50, log_prefix: str = "critic/") -> list[dict]:
    """Minibatch Adam on the critic's losses; returns the logged rows."""
    for name in ("reward", "discount", "mc_return"):
        if not torch.isfinite(getattr(data, name)).all():
            raise ValueError(f"transitions: {name} contains NaN or inf")
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    rows = []
    critic.train()
    for step in progress.bar(iterable=range(1, steps + 1), desc=f"critic ({critic.kind})", unit="step"):
        idx = torch.randint(0, len(data), (batch_size,), generator=gen)
        losses = critic.losses(data.subset(idx))
        total = sum(losses.values())
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        require_finite(nn.utils.clip_grad_norm_(params, 10.0), f"the {critic.kind} critic's gradient norm",
                       f"step {step}", "lower the critic's lr, or check the rewards for NaN")
        optimizer.step()
        critic.after_step()
        if step == 1 or step % log_every == 0 or step == steps:
            row = {k: v.item() for k, v in losses.items()}
            rows.append({"step": step, **row})
            if tracker is not None:
                tracker.log({log_prefix + k: v for k, v in row.items()}, step)
    critic.eval()
    return rows


def critic_state(critic: ChunkCritic) -> dict:
    extra = {"expectile": critic.expectile, "polyak": critic.polyak} if isinstance(critic, IQLCritic) else {}
    return {"kind": critic.kind, "dims": critic.dims, **extra, "state_dict": critic.state_dict()}


def critic_from_state(state: dict) -> ChunkCritic:
    d = state["dims"]
    critic = CRITICS[state["kind"]](d["obs_dim"], d["action_dim"], d["obs_horizon"], d["act_horizon"],
                                    Normalizer(d["obs_dim"]), Normalizer(d["action_dim"]), hidden_dims=d["hidden_dims"],
                                    expectile=state.get("expectile", 0.7), polyak=state.get("polyak", 0.005))
    critic.load_state_dict(state["state_dict"])
    return critic.eval()
