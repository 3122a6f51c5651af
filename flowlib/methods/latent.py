"""Steering a frozen flow policy through its initial noise: PPO on ``x_0`` (DSRL's idea, Wagenmaker et al. 2025).

ReinFlow moves the velocity net's weights along the score of a ``K x H x A``-dim chain whose noise is small
(std 0.05-0.2), so its policy gradient is mostly noise on a CPU-sized batch (docs/stage3.md). DSRL keeps the
flow's weights as stage 1/2 left them and learns where the chain starts. Here the latent policy is Gaussian,

    x_0 ~ pi_phi(. | o) = N(mu_phi(o), sigma^2 I),      mu_phi(o) = b tanh(f_phi(o)),      [H, A]

and the deterministic chain (the ODE, ``K`` Euler steps of the frozen net) maps ``x_0`` to the chunk. The
decision's log-prob is ``log N(x_0; mu, sigma^2)`` over its ``H x A`` dims: no U-Net in it, so PPO re-scores a
decision with one MLP call, and the exploration is the stage-1 policy's own spread (at ``mu = 0, sigma = 1`` the
noisy policy *is* the stage-1 policy, ``x_0 ~ N(0, I)``; ``f_phi``'s last layer starts at 0).  Deterministic
evaluation starts the chain from ``mu_phi(o)``.  ``sigma`` is one learned std per latent dim, squashed into
``[min_noise_std, max_noise_std]`` (the stage-3 noise schedule moves ``max_noise_std``).

DSRL trains ``pi_phi`` with SAC (``flowlib.methods.latent_sac``); this is the on-policy variant, so that the rest of stage 3
(chunks as a semi-MDP, GAE, critic warm-up, the PPO update, the sweep) serves it unchanged.  The agent is the frozen
flow plus the Gaussian head plus PPO's ``V`` (``flowlib.methods.steering``); a decision is stored as ``[x_0, x_K]``.
``benchmarks/latent_steering.py`` measures how far ``x_0`` can move a chunk at a given bound ``b``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flowlib.infra.config import PositiveFloat, PositiveInt
from flowlib.methods.reinflow import score_options
from flowlib.methods.steering import ChunkSteeringAgent, GaussianHead, steer_options


@dataclass
class LatentConfig:
    """The policy over ``x_0`` (steer ``"latent"``, PPO or SAC); its std is bounded by ``min/max_noise_std``."""

    latent_bound: PositiveFloat = 2.5  # the bound on |mu(o)| per dim of x_0
    latent_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [256, 256])  # mu's MLP


def latent_agent(policy, cfg) -> "LatentSteeringAgent":
    """The latent-steering agent of ``cfg`` over a frozen stage-1/2 ``policy``."""
    return LatentSteeringAgent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                               tuple(cfg.value_hidden_dims), cfg.latent_bound, tuple(cfg.latent_hidden_dims),
                               **score_options(cfg))


class LatentSteeringAgent(ChunkSteeringAgent):
    """The frozen flow plus ``pi_phi(x_0 | o)`` (module docstring) and PPO's ``V(o)``.

    ``latent_bound`` ``b``: ``|mu| <= b`` per dim.  ``latent_hidden``: the MLP's hidden sizes.  ``options``: the
    chunk-scoring ones (``flowlib.methods.steering.steer_options``); those of the noisy chain are refused.
    """

    STEER = "latent"  # the config's name for it
    LEGACY_RENAMES = (("latent_net.", "head.net."), ("latent_std_logit", "head.std_logit"),
                      ("latent_std_range", "head.std_range"))

    def __init__(self, policy, num_inference_steps: int = 8, min_noise_std: float = 0.05, max_noise_std: float = 1.0,
                 value_hidden_dims: tuple[int, ...] = (256, 256), latent_bound: float = 2.5,
                 latent_hidden: tuple[int, ...] = (256, 256), **options):
        if not latent_bound > 0:
            raise ValueError(f"latent_bound must be > 0, got {latent_bound}")
        why = f"steer {self.STEER!r} draws one Gaussian per decision (the chain is the ODE)"
        super().__init__(policy, num_inference_steps, value_hidden_dims, **steer_options(options, why))
        # mu = 0 at the start: the stage-1 policy's own x_0
        self.head = GaussianHead(self.obs_horizon * self.obs_dim, self._draw_dims(), latent_bound, latent_hidden,
                                 min_noise_std, max_noise_std)

    @property
    def latent_bound(self) -> float:
        return self.head.bound

    def _draw_dims(self) -> int:  # x_0's H x A dims
        return self.pred_horizon * self.action_dim

    def _latent(self, o: torch.Tensor):  # normalised [B, To, O] -> mu, sigma, each [B, H, A]
        mu, sigma = self.head(o.flatten(1))
        shape = (len(o), self.pred_horizon, self.action_dim)
        return mu.view(shape), sigma.reshape(shape)

    def _sample(self, o, generator, deterministic, x0):
        """``x_0 = mu(o) + sigma eps`` (``eps`` from ``generator``, or ``x0`` when given; ``x_0 = mu(o)`` when
        ``deterministic``), then the flow's ODE from it."""
        mu, sigma = self._latent(o)
        if deterministic:
            start = mu
        else:
            eps = torch.randn(mu.shape, generator=generator) if x0 is None else x0
            start = mu + sigma * eps.to(mu.device)
        return torch.stack([start, self.flow.chunk(o, start)], 1), start, mu, sigma

    def _score(self, o, decision):  # the stored x_0 and its Gaussian
        return (decision[:, 0], *self._latent(o))
