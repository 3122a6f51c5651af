"""RFC, reflow fine-tuning with masks (the RLinf notes): after each rollout, train the flow again on its own chunks.

No likelihood ratio: the noisy chain collects chunk decisions as chain ReinFlow does (``flowlib.methods.reinflow.collect``),
a mask picks the decisions worth imitating, and the velocity net takes the same ShortCut flow-matching loss as in
stage 1 (Frans et al. 2024, Eq. 5; ``flowlib.flows.models.ShortCut.loss``) with the executed rollouts' chunks as data:

    L(theta) = E_{(o, a) in masked rollouts} [ ShortCut loss of a given o ],      a = x_K, the chunk the env ran.

The masks (``rfc_mask``):

- ``success_only``: decisions of episodes that succeeded within the rollout (sparse reward: the episode terminated
  with a positive reward; an episode still running at the rollout's end is not counted);
- ``advantage_positive``: decisions with ``A > 0`` (GAE over chunk decisions, the critic fitted as PPO's);
- ``advantage_topk``: the top ``rfc_topk`` share of live decisions by ``A``; rows tied with the cut-off are all kept.

``reflow_mask_ratio`` (logged) is the share of live decisions the mask keeps.  It is advantage-filtered behaviour
cloning on-policy (in the family of filtered BC / RWR; Peters & Schaal 2007): the value net is fitted on every
decision, the flow only on the kept ones; the noise net is not trained by it (it has no loss here).

Where few decisions are kept per iteration (PickCube at CPU scale keeps 1-9 of 256), three options hold the reflow
back (all off by default, RFC as the notes describe it): ``rfc_buffer`` remembers the last kept decisions over
iterations (first in, first out), ``rfc_min_kept`` reflows only once that many are at hand, and
``rfc_demo_fraction`` draws that share of every reflow minibatch from the start's demonstrations (stage 1's
windows and chunks), which anchors the flow where the kept chunks are few or noisy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from flowlib.infra.config import Fraction, NonNegativeFloat, NonNegativeInt, PositiveInt
from flowlib.infra.guards import require_finite
from flowlib.infra.runs import policy_checkpoint
from flowlib.methods.reinflow import chunk_rollout
from flowlib.policies import bc, chunk_policy
from flowlib.policies.critic import (  # the masks live beside AW-ShortCut's weights (notebook 02 uses both)
    RFC_MASKS,
    rfc_mask,
)
from flowlib.rl.learners import PPOLearner
from flowlib.rl.ppo import explained_variance, ppo_update


@dataclass
class RFCMaskConfig:
    """Which rollout decisions RFC reflows on, as its own learner (``"rfc"``) or beside PPO (``rfc_lambda``)."""

    rfc_mask: str = "advantage_positive"  # the decisions reflowed: success_only / advantage_positive / advantage_topk
                                          # [toolkit: rfc_<mask>_<lambda>]
    rfc_topk: Fraction = 0.25  # advantage_topk: the share of live decisions kept

    def rfc_mask_checks(self) -> list[tuple[bool, str]]:
        return [(self.rfc_mask in RFC_MASKS, f"rfc_mask must be one of {RFC_MASKS}, got {self.rfc_mask!r}"),
                (self.rfc_topk > 0, f"rfc_topk must be in (0, 1], got {self.rfc_topk}"),
                (self.rfc_mask != "success_only" or self.reward == "sparse",
                 f"rfc_mask 'success_only' reads success from the sparse reward (an episode that terminates with "
                 f"r > 0): set reward: sparse (got {self.reward!r}) or mask by advantage"),
                (self.rfc_mask != "success_only" or self.terminate_on_success,
                 "rfc_mask 'success_only' reads success from an episode's termination, and terminate_on_success is "
                 "off: mask by advantage, or let a success end the episode")]


@dataclass
class RFCLossConfig:
    """RFC beside PPO (RLinf's ``ppo_rfc``): ``L = L_PPO + rfc_lambda L_RFC`` (``RFCRegulariser``), steers
    ``"chain"`` and ``"latent"`` with learner ``"ppo"``."""

    rfc_lambda: NonNegativeFloat = 0.0  # weight of the masked reflow loss in PPO's loss (0: off; RLinf's 0.05)
                                        # [toolkit: rfc_<mask>_<lambda>]

    def rfc_loss_checks(self) -> list[tuple[bool, str]]:
        at_default = self.rfc_mask == "advantage_positive" and self.rfc_topk == 0.25
        return [(self.rfc_lambda > 0 or at_default,
                 f"rfc_mask / rfc_topk ({self.rfc_mask!r}, {self.rfc_topk}) choose what RFC beside PPO reflows, and "
                 f"rfc_lambda is 0 (off): set rfc_lambda > 0 or leave them out"),
                (self.rfc_lambda == 0 or self.branches == 1,
                 f"rfc_lambda reflows the chunks of the episodes that ran, and branches ({self.branches}) tries several "
                 f"chunks per state, of which one runs on: use branches: 1 beside rfc_lambda")]


@dataclass
class RFCConfig:
    """RFC's options as a learner of its own (steer ``"chain"``, learner ``"rfc"``); the critic and the advantages
    are PPOConfig's, the mask ``RFCMaskConfig``'s."""

    rfc_epochs: PositiveInt = 1  # passes of the flow-matching loss over the kept decisions per iteration
    rfc_buffer: NonNegativeInt = 0  # kept decisions remembered over iterations, newest last (0: this iteration's only)
    rfc_min_kept: NonNegativeInt = 0  # reflow only once this many kept decisions are at hand (0: whenever any are)
    rfc_demo_fraction: Fraction = 0.0  # the share of each reflow minibatch drawn from the start's demos

    def rfc_checks(self) -> list[tuple[bool, str]]:
        return [(self.rfc_demo_fraction < 1, f"rfc_demo_fraction must be below 1 (the rest of a minibatch is the kept "
                                             f"decisions), got {self.rfc_demo_fraction}")]


def episode_success(rewards: torch.Tensor, terminal: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` bool: the decision belongs to an episode that terminates with a positive reward within the rollout
    (sparse reward).  Backwards: ``s_t = (terminal_t and r_t > 0) or (not end_t and s_{t+1})``, ``s_T = False``."""
    out = torch.zeros_like(terminal, dtype=torch.bool)
    nxt = torch.zeros_like(terminal[0], dtype=torch.bool)
    for t in reversed(range(len(rewards))):
        nxt = (terminal[t].bool() & (rewards[t] > 0)) | (~ends[t].bool() & nxt)
        out[t] = nxt
    return out


class RFCLearner(PPOLearner):
    """PPO's rollouts and critic, with the policy step replaced by the masked reflow (module docstring)."""

    def __init__(self, agent, cfg):
        super().__init__(agent, cfg, chunk_rollout(cfg), name="RFC")
        self.flow = chunk_policy.flow_model(agent.meta, agent.actor.base, None)  # the live net, no EMA: reflow moves it
        self.kept = {"obs": torch.zeros(0, agent.obs_horizon, agent.obs_dim),           # [m, To, O] raw windows
                     "chunks": torch.zeros(0, agent.pred_horizon, agent.action_dim)}    # [m, H, A] normalised x_K
        self.demos = start_demo_chunks(agent, cfg) if cfg.rfc_demo_fraction > 0 else None

    def update(self, buf, train_policy: bool) -> dict[str, float]:
        cfg = self.cfg
        advantages, returns = buf.advantages(cfg)
        # the critic: PPO's value fit on every decision (the policy is not moved by it)
        stats = ppo_update(self.agent, buf.flat(advantages, returns), self.actor_opt, self.critic_opt, cfg,
                           train_policy=False, generator=self.gen)
        live = buf.weights > 0
        stats["explained_variance"] = explained_variance(buf.values[live], returns[live])
        mask = rollout_mask(buf, advantages, cfg)
        stats["reflow_mask_ratio"] = float(mask.sum() / live.sum().clamp(min=1))
        if train_policy:
            self._keep(buf, mask)
            stats["reflow_kept"] = len(self.kept["obs"])
            if len(self.kept["obs"]) >= max(1, cfg.rfc_min_kept):
                stats["reflow_loss"] = self._reflow()
        return stats

    def _keep(self, buf, mask: torch.Tensor) -> None:
        """The kept decisions of this rollout (``mask [T * N]``), added to those remembered (``rfc_buffer``)."""
        n = buf.rewards.numel()
        new = {"obs": buf.obs.reshape(n, *buf.obs.shape[2:])[mask].cpu(),                   # [m, To, O] raw
               "chunks": buf.chains.reshape(n, *buf.chains.shape[2:])[mask][:, -1].cpu()}   # [m, H, A] normalised x_K
        cap = self.cfg.rfc_buffer
        self.kept = {k: torch.cat([self.kept[k], new[k]])[-cap:] if cap else new[k] for k in new}

    def _reflow(self) -> float:
        """``rfc_epochs`` passes of the ShortCut loss over the kept decisions' executed chunks, in minibatches of
        ``minibatch_size`` of which ``rfc_demo_fraction`` are demo windows drawn at random."""
        agent, cfg = self.agent, self.cfg
        device = next(agent.parameters()).device
        obs, chunks = self.kept["obs"].to(device), self.kept["chunks"].to(device)
        n_demo = 0 if self.demos is None else min(round(cfg.minibatch_size * cfg.rfc_demo_fraction),
                                                  cfg.minibatch_size - 1)  # at least one kept decision a batch
        per_batch = cfg.minibatch_size - n_demo
        losses = []
        for epoch in range(cfg.rfc_epochs):
            perm = torch.randperm(len(obs), generator=self.gen).to(device)
            for start in range(0, len(obs), per_batch):
                idx = perm[start:start + per_batch]
                batch_obs, batch_chunks = obs[idx], chunks[idx]
                if n_demo:
                    d = torch.randint(len(self.demos["obs"]), (n_demo,), generator=self.gen)
                    batch_obs = torch.cat([batch_obs, self.demos["obs"][d].to(device)])
                    batch_chunks = torch.cat([batch_chunks, self.demos["chunks"][d].to(device)])
                loss, _ = self.flow.loss(batch_chunks, obs=agent._norm_obs(batch_obs))
                self.actor_opt.zero_grad(set_to_none=True)
                loss.backward()
                require_finite(nn.utils.clip_grad_norm_(agent.policy_parameters(), cfg.max_grad_norm),
                               "the reflow gradient norm", f"epoch {epoch}", "lower actor_lr")
                self.actor_opt.step()
                losses.append(loss.item())
        return float(sum(losses) / len(losses))

    def state(self) -> dict:
        return {**super().state(), "rfc_kept": self.kept} if self.cfg.rfc_buffer else super().state()

    def load_state(self, ckpt: dict, path) -> None:
        super().load_state(ckpt, path)
        if self.cfg.rfc_buffer and "rfc_kept" in ckpt:
            self.kept = ckpt["rfc_kept"]


def rollout_mask(buf, advantages: torch.Tensor, cfg) -> torch.Tensor:
    """``[T * N]`` bool, in ``buf.flat``'s order: the decisions ``cfg.rfc_mask`` keeps of a rollout."""
    success = episode_success(buf.rewards, buf.terminal, buf.ends)
    return rfc_mask(cfg.rfc_mask, advantages.flatten(), success.flatten(), buf.weights.flatten(), cfg.rfc_topk)


class RFCRegulariser:
    """RFC beside PPO (RLinf's ``ppo_rfc``, ``rfc_lambda``): PPO's loss gains ``rfc_lambda`` times the masked reflow
    loss of the minibatch,

        L = L_PPO + rfc_lambda * sum_i m_i l_i / sum_i m_i,     l_i = the stage-1 loss (ShortCut: Frans et al. 2024,
                                                                Eq. 5) of the executed chunk x_K given o_i,

    with ``m_i`` the rollout's mask (``rfc_mask``; 0 for dead rows), so the flow is pulled toward the chunks worth
    imitating while PPO moves it by the ratio.  On the chain steer it trains the velocity net PPO trains; on the
    latent steer (DSRL) it is what moves the flow at all (PPO's ratio is over ``x_0``, the head's), so the x_0 head and
    the reflow learn in one run.  ``ppo.ppo_update`` calls it per minibatch (``weights``, ``__call__``); the learner's
    ``prepare`` puts the mask in the batch.  Logged as ``rfc_loss`` (the masked mean) and ``rfc_kept`` (the share
    of live decisions kept).  The loss's ``x_0`` and times come from torch's global generator, as stage 1's do."""

    name = "rfc_loss"  # its column in the log

    def __init__(self, agent, cfg):
        self.cfg, self.coeff = cfg, float(cfg.rfc_lambda)
        if hasattr(agent, "actor"):           # the chain: the velocity net PPO moves
            net, self.norm_obs = agent.actor.base, agent._norm_obs
        else:                                 # a steer of the frozen flow (latent): the reflow unfreezes it
            net, self.norm_obs = agent.flow.net.requires_grad_(True), agent.norm_obs
            agent.train_flow = True          # policy_parameters() then include it
        self.flow = chunk_policy.flow_model(agent.meta, net, None)  # the live net, no EMA
        self.kept_share = float("nan")

    def prepare(self, buf, advantages: torch.Tensor, batch: dict) -> None:
        mask = rollout_mask(buf, advantages, self.cfg)
        batch["rfc_mask"] = mask
        self.kept_share = float(mask.sum() / (buf.weights > 0).sum().clamp(min=1))

    def log(self) -> dict[str, float]:
        return {"rfc_kept": self.kept_share}

    def weights(self, batch: dict, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * batch["rfc_mask"][idx].to(w.dtype)

    def __call__(self, batch: dict, rows: torch.Tensor, weights: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        keep = weights > 0
        if not keep.any():
            return torch.zeros((), device=weights.device)
        rows = rows[keep]
        x1 = batch["chains"][rows][:, -1]                       # [m, H, A] the executed chunks, normalised
        loss, _ = self.flow.loss(x1, obs=self.norm_obs(batch["obs"][rows]), weight=weights[keep])
        return loss * len(rows)                                 # sum_i w_i l_i (the loss is their mean)


def rfc_beside(make_learner):
    """``make_learner(agent, cfg)`` (a ``PPOLearner`` builder) with ``RFCRegulariser`` in its loss when
    ``cfg.rfc_lambda > 0``; the learner logs ``rfc_kept`` then."""
    def build(agent, cfg):
        learner = make_learner(agent, cfg)
        if cfg.rfc_lambda > 0:
            learner.regularisers = (*learner.regularisers, RFCRegulariser(agent, cfg))
        return learner
    return build


def start_demo_chunks(agent, cfg) -> dict[str, torch.Tensor]:
    """Stage 1's training windows of the start checkpoint: raw ``obs [N, To, O]`` and ``chunks [N, H, A]``
    normalised by the agent's action normaliser, as the rollouts' ``x_K`` are (on the CPU)."""
    obs_n, chunks = bc.training_windows(policy_checkpoint(cfg.init_checkpoint, "init_checkpoint"), agent)
    with torch.no_grad():
        return {"obs": agent.obs_normalizer.unnormalize(obs_n).cpu(), "chunks": chunks.cpu()}


def rfc_learner(agent, cfg) -> RFCLearner:
    return RFCLearner(agent, cfg)
