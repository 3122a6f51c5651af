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

DSRL trains ``pi_phi`` with SAC; this is the on-policy variant, so that the rest of stage 3 (chunks as a semi-MDP,
GAE, critic warm-up, the PPO update, the sweep) serves it unchanged: ``LatentSteeringAgent`` has the interface of
``ReinFlowAgent``, and its chains' step 0 carries the draw of ``x_0`` (the ``[B, K]`` stochastic mask is true in
column 0 only).  ``benchmarks/latent_steering.py`` measures how far ``x_0`` can move a chunk at a given bound ``b``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import PositiveFloat, PositiveInt
from .flow_sde import gaussian_entropy, gaussian_log_prob
from .nets import mlp
from .reinflow import score_options
from .reinflow_agent import ReinFlowAgent


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


def refuse_chain_options(kwargs: dict, why: str) -> None:
    """For agents that run the frozen flow's ODE: a ``ReinFlowAgent`` option of the noisy chain that is set away
    from its default has no meaning there; raise naming it and ``why``."""
    for key, default in (("hybrid", False), ("include_initial_noise", False), ("noise_corr", 0.0),
                         ("noise_method", "reinflow"), ("log_prob_over", "chunk")):
        if kwargs.get(key, default) != default:
            raise ValueError(f"{why}: {key} must be {default!r}, got {kwargs[key]!r}")


class LatentSteeringAgent(ReinFlowAgent):
    """``ReinFlowAgent`` whose policy is ``pi_phi(x_0 | o)`` (module docstring); the flow net is frozen.

    ``latent_bound`` ``b``: ``|mu| <= b`` per dim.  ``latent_hidden``: the MLP's hidden sizes.  Refuses what
    has no meaning here: hybrid sampling, the initial-noise term, correlated chain noise and SDE methods.
    """

    STEER = "latent"  # the config's name for it

    def __init__(self, policy, num_inference_steps: int = 8, min_noise_std: float = 0.05, max_noise_std: float = 1.0,
                 value_hidden_dims: tuple[int, ...] = (256, 256), latent_bound: float = 2.5,
                 latent_hidden: tuple[int, ...] = (256, 256), **kwargs):
        refuse_chain_options(kwargs, f"steer {self.STEER!r} draws one Gaussian per decision (the chain is the ODE)")
        if not latent_bound > 0:
            raise ValueError(f"latent_bound must be > 0, got {latent_bound}")
        super().__init__(policy, num_inference_steps, min_noise_std, max_noise_std, value_hidden_dims, **kwargs)
        self.actor.base.requires_grad_(False)  # the flow stays as stage 1/2 left it
        self.latent_bound = float(latent_bound)
        n_in, D = self._head_sizes()
        self.latent_net = mlp([n_in, *latent_hidden, D], act=nn.Mish)
        nn.init.zeros_(self.latent_net[-1].weight)
        nn.init.zeros_(self.latent_net[-1].bias)  # mu = 0 at the start: the stage-1 policy's own x_0
        self.latent_std_logit = nn.Parameter(torch.full((D,), 3.0))  # sigma ~ 0.95 max_noise_std at the start
        self.register_buffer("latent_std_range", torch.tensor([float(min_noise_std), float(max_noise_std)]))

    def _head_sizes(self) -> tuple[int, int]:  # the Gaussian head's input (the obs window) and output (x_0) sizes
        return self.obs_horizon * self.obs_dim, self.pred_horizon * self.action_dim

    def _gaussian(self, head_in: torch.Tensor, shape: tuple[int, ...]):  # [B, n_in] -> mu, sigma, each ``shape``
        mu = self.latent_bound * torch.tanh(self.latent_net(head_in)).view(shape)
        lo, hi = self.latent_std_range
        sigma = (lo + (hi - lo) * torch.sigmoid(self.latent_std_logit)).view(1, *shape[1:]).expand(shape)
        return mu, sigma

    def _latent(self, o: torch.Tensor):  # normalised [B, To, O] -> mu, sigma, each [B, H, A]
        return self._gaussian(o.flatten(1), (o.shape[0], self.pred_horizon, self.action_dim))

    def _step_dims(self, device=None) -> torch.Tensor:  # [K]: x_0's H x A dims, counted at step 0
        dims = torch.zeros(self.K, device=device)
        dims[0] = self.pred_horizon * self.action_dim
        return dims

    def policy_parameters(self):
        return [*self.latent_net.parameters(), self.latent_std_logit]

    def set_max_noise_std(self, value: float) -> None:
        self.latent_std_range[1] = value

    def stochastic_mask(self, B: int, generator: torch.Generator | None = None) -> torch.Tensor:
        mask = torch.zeros(B, self.K, dtype=torch.bool)
        mask[:, 0] = True  # the draw of x_0
        return mask

    @torch.no_grad()
    def sample(self, obs_window: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False,
               return_steps: bool = False, x0: torch.Tensor | None = None):
        """``x_0 = mu(o) + sigma eps`` (``eps`` from ``generator``, or ``x0`` when given; ``x_0 = mu(o)`` when
        ``deterministic``), then the ODE chain. Returns what ``ReinFlowAgent.sample`` does."""
        o = self._norm_obs(obs_window)
        mu, sigma = self._latent(o)
        if deterministic:
            start = mu
        else:
            eps = torch.randn(mu.shape, generator=generator) if x0 is None else x0
            start = mu + sigma * eps.to(mu.device)
        chain, _ = super().sample(obs_window, deterministic=True, x0=start)
        return self._decision(chain, start, mu, sigma, deterministic, return_steps)

    def _decision(self, chain, draw, mu, sigma, deterministic: bool, return_steps: bool):
        """What ``sample`` returns for a decision whose one Gaussian draw is ``draw ~ N(mu, sigma^2)``: its
        log-density in step 0 of the ``[B, K]`` step log-probs (none when ``deterministic``)."""
        B = len(chain)
        stochastic = torch.zeros(B, self.K, dtype=torch.bool, device=chain.device)
        step_lp = torch.zeros(B, self.K, device=chain.device)
        if not deterministic:
            stochastic[:, 0] = True
            step_lp[:, 0] = gaussian_log_prob(draw, mu, sigma)
        log_prob = self.joint_log_prob(step_lp, stochastic, chain) if not deterministic else step_lp[:, 0]
        return (chain, log_prob, stochastic, step_lp) if return_steps else (chain, log_prob)

    def _rescore(self, chain, stochastic, gaussian):
        """``step_log_probs`` for ``gaussian(chain) -> (draw, mu, sigma)``: the stored draw and its Gaussian."""
        if chain.shape[1:] != (self.K + 1, self.pred_horizon, self.action_dim):
            raise ValueError(f"chain must be [B, {self.K + 1}, {self.pred_horizon}, {self.action_dim}], got {tuple(chain.shape)}")
        B = len(chain)
        stochastic = self.stochastic_mask(B).to(chain.device) if stochastic is None else stochastic.to(chain.device)
        draw, mu, sigma = gaussian(chain)
        lp = gaussian_log_prob(draw, mu, sigma) * stochastic[:, 0]
        step_lp = torch.cat([lp[:, None], torch.zeros(B, self.K - 1, device=chain.device)], 1)
        return step_lp, gaussian_entropy(sigma)

    def step_log_probs(self, obs_window: torch.Tensor, chain: torch.Tensor, stochastic: torch.Tensor | None = None):
        """``[B, K]`` with ``log N(x_0; mu, sigma^2)`` in column 0 (where ``stochastic`` says x_0 was drawn), and
        the mean per-dim entropy of the latent Gaussian ``[B]``."""
        return self._rescore(chain, stochastic, lambda c: (c[:, 0], *self._latent(self._norm_obs(obs_window))))
