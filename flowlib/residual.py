"""Residual steering: PPO on a small Gaussian correction added to a frozen flow policy's executed actions.

ReinFlow moves the flow's weights and ``flowlib.latent`` moves where its chain starts; both act on the action
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
gripper's action stays the base's, as ``flowlib.residual_step`` allows; the log-prob then has ``n x (A - 1)`` dims.

The decision's log-prob is ``log N(r; mu, sigma^2)`` over its ``Ta x A`` (or ``A``) dims: the draw of ``x_0`` is the
environment's as far as ``phi`` is concerned (it does not depend on ``phi``), so it cancels in PPO's ratio, and
re-scoring a decision is one MLP call.  ``f_phi``'s last layer starts at 0, so at the start ``mu = 0`` and the
deterministic policy is the stage-1 policy exactly (its own ``x_0 ~ N(0, I)``: evaluation draws it, as stage 1's
does); the noisy one adds ``sigma ~ 0.95 max_noise_std`` per dim.  Failures that end a few centimetres from
the goal (docs/stage3.md) are what the correction can reach directly; the base keeps the rest of the skill.

The stored chain keeps the format of the other agents, ``[B, K+1, H, A]``: step 0 holds the residual ``r``
in the first executed rows (zeros elsewhere) in place of ``x_0``, as ``flowlib.latent`` holds its drawn ``x_0``
there; steps ``1..K-1`` are the base chain's; step ``K`` is the chunk with ``r`` added, so
``a_b = x_K - r`` is recovered for re-scoring without the U-Net.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import PositiveFloat, PositiveInt
from .latent import LatentSteeringAgent
from .reinflow import score_options
from .reinflow_agent import ReinFlowAgent

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


class ResidualAgent(LatentSteeringAgent):
    """The frozen flow plus ``pi_phi(r | o, a_b)`` (module docstring); ``residual_bound`` is ``b`` (``|mu| <= b``
    per dim, normalised action units), ``residual_hidden`` the MLP's hidden sizes; ``[min, max]_noise_std`` bound
    ``sigma``.  ``residual_per``: ``"action"``, one correction per executed action (``r [Ta, A]``), or
    ``"chunk"``, one for the whole chunk (``r [1, A]``, added to each of its ``Ta`` actions: an ``A``-dim
    Gaussian whose every dim moves ``Ta`` actions at once).  ``correct_gripper`` False leaves the last action dim
    to the base (``r`` has ``A - 1`` dims).  Sampling, PPO, evaluation and checkpoints are those of
    ``LatentSteeringAgent``."""

    STEER = "residual"

    def __init__(self, policy, num_inference_steps: int = 8, min_noise_std: float = 0.01, max_noise_std: float = 0.2,
                 value_hidden_dims: tuple[int, ...] = (256, 256), residual_bound: float = 0.5,
                 residual_hidden: tuple[int, ...] = (256, 256), residual_per: str = "action",
                 correct_gripper: bool = True, **kwargs):
        if not residual_bound > 0:
            raise ValueError(f"residual_bound must be > 0, got {residual_bound}")
        if residual_per not in RESIDUAL_PER:
            raise ValueError(f"residual_per must be one of {RESIDUAL_PER}, got {residual_per!r}")
        self.residual_per = residual_per
        self.correct_gripper = bool(correct_gripper)
        super().__init__(policy, num_inference_steps, min_noise_std, max_noise_std, value_hidden_dims, residual_bound,
                         residual_hidden, **kwargs)

    @property
    def _rows(self) -> int:  # n: the residual's rows, Ta ("action") or 1 ("chunk")
        return self.act_horizon if self.residual_per == "action" else 1

    @property
    def _dims(self) -> int:  # r's dims per row: A, or the arm's A - 1 when the gripper is left to the base
        return self.action_dim if self.correct_gripper else self.action_dim - 1

    def _head_sizes(self) -> tuple[int, int]:  # (obs window, base actions) -> residual
        return self.obs_horizon * self.obs_dim + self.act_horizon * self.action_dim, self._rows * self._dims

    def _residual(self, o: torch.Tensor, base: torch.Tensor):  # [B, To, O], [B, Ta, A] normalised -> [B, n, d] x 2
        return self._gaussian(torch.cat([o.flatten(1), base.flatten(1)], 1), (len(base), self._rows, self._dims))

    def _step_dims(self, device=None) -> torch.Tensor:  # [K]: r's n x d dims, counted at step 0
        dims = torch.zeros(self.K, device=device)
        dims[0] = self._rows * self._dims
        return dims

    def _with_residual(self, chain: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The stored chain (module docstring): ``r [B, n, d]`` at step 0's first ``n`` executed rows (0 in the
        gripper's column when it is the base's), and added to (broadcast over) step K's executed rows."""
        start = self.obs_horizon - 1
        r = torch.nn.functional.pad(r, (0, self.action_dim - self._dims))  # [B, n, A]
        out = chain.clone()
        out[:, 0] = 0.0
        out[:, 0, start:start + self._rows] = r
        out[:, -1, start:start + self.act_horizon] += r
        return out

    @torch.no_grad()
    def sample(self, obs_window: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False,
               return_steps: bool = False, x0: torch.Tensor | None = None):
        """The base chunk from ``x_0`` (``x0``, or ``N(0, I)`` from ``generator``; drawn also when
        ``deterministic``, as stage 1 evaluates), then ``r = mu + sigma eps`` (``r = mu`` when ``deterministic``).
        Returns what ``ReinFlowAgent.sample`` does."""
        o = self._norm_obs(obs_window)
        base, _ = ReinFlowAgent.sample(self, obs_window, generator, deterministic=True, x0=x0)
        mu, sigma = self._residual(o, self._executed(base[:, -1]))
        r = mu if deterministic else mu + sigma * torch.randn(mu.shape, generator=generator).to(mu.device)
        return self._decision(self._with_residual(base, r), r, mu, sigma, deterministic, return_steps)

    def step_log_probs(self, obs_window: torch.Tensor, chain: torch.Tensor, stochastic: torch.Tensor | None = None):
        """``[B, K]`` with ``log N(r; mu(o, a_b), sigma^2)`` in column 0 (where ``stochastic`` says r was drawn),
        ``a_b = x_K - r`` on the executed rows, and the mean per-dim entropy of the residual Gaussian ``[B]``."""
        def gaussian(chain):
            r = self._executed(chain[:, 0])[:, :self._rows]                     # [B, n, A], 0 where r has no dim
            return (r[..., :self._dims], *self._residual(self._norm_obs(obs_window), self._executed(chain[:, -1]) - r))

        return self._rescore(chain, stochastic, gaussian)
