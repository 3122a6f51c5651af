"""Residual steering: PPO on a small Gaussian correction added to a frozen flow policy's executed actions.

ReinFlow moves the flow's weights and ``flowlib.methods.latent`` moves where its chain starts; both act on the action
*through* the flow.  Residual RL (Silver et al. 2018; Johannink et al. 2019) acts on the action itself: the
stage-1 policy proposes a chunk and a second, small policy adds a bounded correction to the ``Ta`` actions that
run.  With a chunked diffusion/flow base this is ResiP (Ankile et al. 2024, Eq. 1) and Policy Decorator (Yuan
et al. 2024, Eq. 2, whose bound ``alpha`` on the residual plays the part of ``b`` here).  In the flow's
normalised action space, with ``a_b`` the base chunk's executed part::

    x_0 ~ N(0, I),   x_K = ODE_theta(x_0 | o)    (the frozen flow, K Euler steps),   a_b = x_K[To-1 : To-1+Ta]
    r ~ pi_phi(. | o, a_b) = N(mu_phi(o, a_b), sigma^2 I),     mu_phi = b tanh(f_phi(o, a_b)),        [Ta, A]
    a = a_b + r

With ``residual_per: chunk`` the correction is one ``r [1, A]`` added to every executed action: ``A`` dims
instead of ``Ta x A``, each of which moves the whole chunk, and the per-step noise is the same.  With
``correct_gripper`` False, ``r`` has the arm's ``A - 1`` dims (ManiSkill's ``pd_ee_delta_pos``: dx, dy, dz) and the
gripper's action stays the base's, as ``flowlib.methods.residual_step`` allows; the log-prob then has ``n x (A - 1)`` dims.

The decision's log-prob is ``log N(r; mu, sigma^2)`` over its ``Ta x A`` (or ``A``) dims: the draw of ``x_0`` is the
environment's as far as ``phi`` is concerned (it does not depend on ``phi``), so it cancels in PPO's ratio, and
re-scoring a decision is one MLP call.  ``f_phi``'s last layer starts at 0, so at the start ``mu = 0`` and the
deterministic policy is the stage-1 policy exactly (its own ``x_0 ~ N(0, I)``: evaluation draws it, as stage 1's
does); the noisy one adds ``sigma ~ 0.95 max_noise_std`` per dim.  Failures that end a few centimetres from
the goal (docs/stage3.md) are what the correction can reach directly; the base keeps the rest of the skill.

The agent is the frozen flow plus the Gaussian head plus PPO's ``V`` (``flowlib.methods.steering``).  A decision is stored as
``[B, 2, H, A]``: row 0 holds ``r`` in the first ``n`` executed rows (zeros elsewhere, and in the gripper's column
when the base keeps it), row 1 the chunk with ``r`` added, so ``a_b = x_K - r`` is recovered for re-scoring without
the velocity net.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flowlib.infra.config import PositiveFloat, PositiveInt
from flowlib.methods.reinflow import score_options
from flowlib.methods.steering import ChunkSteeringAgent, GaussianHead, steer_options

RESIDUAL_PER = ("action", "chunk")  # one correction per executed action, or one for the whole chunk


@dataclass
class ResidualConfig:
    """A bounded correction ``r`` of the frozen flow's actions (steers ``"residual"`` and ``"residual_step"``); its
    exploration std is bounded by ``min/max_noise_std``."""

    residual_bound: PositiveFloat = 0.5  # the bound on |mu| per dim (normalised action units)
    residual_gripper: bool = True  # False leaves the last action dim (the gripper) to the base
    residual_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [256, 256])  # mu's MLP


@dataclass
class ChunkResidualConfig:
    """The residual chosen once per chunk (steer ``"residual"``)."""

    residual_per: str = "action"  # "action": r [Ta, A], one per executed action; "chunk": r [A], for all Ta

    def residual_checks(self) -> list[tuple[bool, str]]:
        return [(self.residual_per in RESIDUAL_PER,
                 f"residual_per must be one of {RESIDUAL_PER}, got {self.residual_per!r}")]


def residual_agent(policy, cfg) -> "ResidualAgent":
    """The chunk-level residual agent of ``cfg`` over a frozen stage-1/2 ``policy``."""
    return ResidualAgent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                         tuple(cfg.value_hidden_dims), cfg.residual_bound, tuple(cfg.residual_hidden_dims),
                         cfg.residual_per, correct_gripper=cfg.residual_gripper, **score_options(cfg))


class ResidualAgent(ChunkSteeringAgent):
    """The frozen flow plus ``pi_phi(r | o, a_b)`` (module docstring) and PPO's ``V(o)``; ``residual_bound`` is ``b``
    (``|mu| <= b`` per dim, normalised action units), ``residual_hidden`` the MLP's hidden sizes;
    ``[min, max]_noise_std`` bound ``sigma``.  ``residual_per``: ``"action"``, one correction per executed action
    (``r [Ta, A]``), or ``"chunk"``, one for the whole chunk (``r [1, A]``, added to each of its ``Ta`` actions: an
    ``A``-dim Gaussian whose every dim moves ``Ta`` actions at once).  ``correct_gripper`` False leaves the last
    action dim to the base (``r`` has ``A - 1`` dims)."""

    STEER = "residual"
    LEGACY_RENAMES = (("latent_net.", "head.net."), ("latent_std_logit", "head.std_logit"),
                      ("latent_std_range", "head.std_range"))

    def __init__(self, policy, num_inference_steps: int = 8, min_noise_std: float = 0.01, max_noise_std: float = 0.2,
                 value_hidden_dims: tuple[int, ...] = (256, 256), residual_bound: float = 0.5,
                 residual_hidden: tuple[int, ...] = (256, 256), residual_per: str = "action",
                 correct_gripper: bool = True, **options):
        if not residual_bound > 0:
            raise ValueError(f"residual_bound must be > 0, got {residual_bound}")
        if residual_per not in RESIDUAL_PER:
            raise ValueError(f"residual_per must be one of {RESIDUAL_PER}, got {residual_per!r}")
        why = f"steer {self.STEER!r} draws one Gaussian per decision (the chain is the ODE)"
        super().__init__(policy, num_inference_steps, value_hidden_dims, **steer_options(options, why))
        self.residual_per, self.correct_gripper = residual_per, bool(correct_gripper)
        n_in = self.obs_horizon * self.obs_dim + self.act_horizon * self.action_dim  # (obs window, base actions)
        # mu = 0 at the start: the stage-1 policy
        self.head = GaussianHead(n_in, self._draw_dims(), residual_bound, residual_hidden, min_noise_std, max_noise_std)

    @property
    def _rows(self) -> int:  # n: the residual's rows, Ta ("action") or 1 ("chunk")
        return self.act_horizon if self.residual_per == "action" else 1

    @property
    def _dims(self) -> int:  # r's dims per row: A, or the arm's A - 1 when the gripper is left to the base
        return self.action_dim if self.correct_gripper else self.action_dim - 1

    @property
    def residual_bound(self) -> float:
        return self.head.bound

    def _draw_dims(self) -> int:  # r's n x d dims
        return self._rows * self._dims

    def _residual(self, o: torch.Tensor, base: torch.Tensor):  # [B, To, O], [B, Ta, A] normalised -> [B, n, d] x 2
        mu, sigma = self.head(torch.cat([o.flatten(1), base.flatten(1)], 1))
        shape = (len(base), self._rows, self._dims)
        return mu.view(shape), sigma.reshape(shape)

    def _with_residual(self, chunk: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The stored decision (module docstring) of the base ``chunk [B, H, A]`` and ``r [B, n, d]``: ``r`` in row
        0's first ``n`` executed rows (0 in the gripper's column when it is the base's), and added to (broadcast over)
        row 1's executed rows."""
        start = self.obs_horizon - 1
        r = torch.nn.functional.pad(r, (0, self.action_dim - self._dims))  # [B, n, A]
        draw, out = torch.zeros_like(chunk), chunk.clone()
        draw[:, start:start + self._rows] = r
        out[:, start:start + self.act_horizon] += r
        return torch.stack([draw, out], 1)

    def _sample(self, o, generator, deterministic, x0):
        """The base chunk from ``x_0`` (``x0``, or ``N(0, I)`` from ``generator``; drawn also when ``deterministic``,
        as stage 1 evaluates), then ``r = mu + sigma eps`` (``r = mu`` when ``deterministic``)."""
        x0 = self.flow.draw_x0(len(o), generator) if x0 is None else x0
        base = self.flow.chunk(o, x0)
        mu, sigma = self._residual(o, self.flow.executed(base))
        r = mu if deterministic else mu + sigma * torch.randn(mu.shape, generator=generator).to(mu.device)
        return self._with_residual(base, r), r, mu, sigma

    def _score(self, o, decision):
        """The stored ``r`` and its Gaussian at ``a_b = x_K - r`` on the executed rows."""
        r = self.flow.executed(decision[:, 0])[:, :self._rows]                  # [B, n, A], 0 where r has no dim
        return (r[..., :self._dims], *self._residual(o, self.flow.executed(decision[:, -1]) - r))
