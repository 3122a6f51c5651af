"""RFC, reflow fine-tuning with masks (the RLinf notes): after each rollout, train the flow again on its own chunks.

No likelihood ratio: the noisy chain collects chunk decisions as chain ReinFlow does (``flowlib.reinflow.collect``),
a mask picks the decisions worth imitating, and the velocity net takes the same ShortCut flow-matching loss as in
stage 1 (Frans et al. 2024, Eq. 5; ``flowlib.flows.ShortCut.loss``) with the executed rollouts' chunks as data:

    L(theta) = E_{(o, a) in masked rollouts} [ ShortCut loss of a given o ],      a = x_K, the chunk the env ran.

The masks (``rfc_mask``):

- ``success_only``: decisions of episodes that succeeded within the rollout (sparse reward: the episode terminated
  with a positive reward; an episode still running at the rollout's end is not counted);
- ``advantage_positive``: decisions with ``A > 0`` (GAE over chunk decisions, the critic fitted as PPO's);
- ``advantage_topk``: the top ``rfc_topk`` share of live decisions by ``A``; rows tied with the cut-off are all kept.

``reflow_mask_ratio`` (logged) is the share of live decisions the mask keeps.  It is advantage-filtered behaviour
cloning on-policy (in the family of filtered BC / RWR; Peters & Schaal 2007): the value net is fitted on every
decision, the flow only on the kept ones; the noise net is not trained by it (it has no loss here).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import Fraction, PositiveInt
from .critic import RFC_MASKS, rfc_mask  # the masks live beside AW-ShortCut's weights (notebook 02 uses both)
from .flows import ShortCut
from .guards import require_finite
from .learners import PPOLearner
from .ppo import explained_variance, ppo_update
from .reinflow import chunk_rollout


@dataclass
class RFCConfig:
    """RFC's options (steer ``"chain"``, learner ``"rfc"``); the critic and the advantages are PPOConfig's."""

    rfc_mask: str = "advantage_positive"  # the decisions reflowed: success_only / advantage_positive / advantage_topk
    rfc_topk: Fraction = 0.25  # advantage_topk: the share of live decisions kept
    rfc_epochs: PositiveInt = 1  # passes of the flow-matching loss over the kept decisions per iteration

    def rfc_checks(self) -> list[tuple[bool, str]]:
        return [(self.rfc_mask in RFC_MASKS, f"rfc_mask must be one of {RFC_MASKS}, got {self.rfc_mask!r}"),
                (self.rfc_topk > 0, f"rfc_topk must be in (0, 1], got {self.rfc_topk}")]


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
        meta = agent.meta
        self.flow = ShortCut(agent.actor.base, ema_decay=None, max_steps=meta["shortcut_max_steps"],
                             bootstrap_fraction=meta["bootstrap_fraction"])  # the live net, no EMA: reflow moves it

    def update(self, buf, train_policy: bool) -> dict[str, float]:
        cfg = self.cfg
        advantages, returns = buf.advantages(cfg)
        # the critic: PPO's value fit on every decision (the policy is not moved by it)
        stats = ppo_update(self.agent, buf.flat(advantages, returns), self.actor_opt, self.critic_opt, cfg,
                           train_policy=False, generator=self.gen)
        live = buf.weights > 0
        stats["explained_variance"] = explained_variance(buf.values[live], returns[live])
        success = episode_success(buf.rewards, buf.terminal, buf.ends)
        mask = rfc_mask(cfg.rfc_mask, advantages.flatten(), success.flatten(), buf.weights.flatten(), cfg.rfc_topk)
        stats["reflow_mask_ratio"] = float(mask.sum() / live.sum().clamp(min=1))
        if train_policy and mask.any():
            stats["reflow_loss"] = self._reflow(buf, mask)
        return stats

    def _reflow(self, buf, mask: torch.Tensor) -> float:
        """``rfc_epochs`` passes of the ShortCut loss over the kept decisions' executed chunks, in minibatches."""
        agent, cfg = self.agent, self.cfg
        device = next(agent.parameters()).device
        n = buf.rewards.numel()
        obs = buf.obs.reshape(n, *buf.obs.shape[2:])[mask].to(device)             # [m, To, O] raw
        chunks = buf.chains.reshape(n, *buf.chains.shape[2:])[mask][:, -1].to(device)  # [m, H, A] normalised x_K
        losses = []
        for epoch in range(cfg.rfc_epochs):
            perm = torch.randperm(len(obs), generator=self.gen).to(device)
            for start in range(0, len(obs), cfg.minibatch_size):
                idx = perm[start:start + cfg.minibatch_size]
                loss, _ = self.flow.loss(chunks[idx], obs=agent._norm_obs(obs[idx]))
                self.actor_opt.zero_grad(set_to_none=True)
                loss.backward()
                require_finite(nn.utils.clip_grad_norm_(agent.policy_parameters(), cfg.max_grad_norm),
                               "the reflow gradient norm", f"epoch {epoch}", "lower actor_lr")
                self.actor_opt.step()
                losses.append(loss.item())
        return float(sum(losses) / len(losses))


def rfc_learner(agent, cfg) -> RFCLearner:
    return RFCLearner(agent, cfg)
