"""Stochastic denoising steps for flow policies: the noise-injection family of piRL (Chen et al. 2025).

Conventions (flowlib's, used everywhere here): ``t = 0`` is noise, ``t = 1`` is data,
``x_t = (1 - t) x_0 + t x_1`` and ``v(x, t) = E[x_1 - x_0 | x_t = x]``.  piRL, Flow-GRPO and the
RLinf code use the opposite clock (``t = 1`` noise); every formula below is theirs with
``t -> 1 - t`` and ``v -> -v``, and says so.

Score from velocity
-------------------
``x_t = x_0 + t v`` in expectation, so ``E[x_0 | x_t] = x - t v`` and, since ``x_0 ~ N(0, I)`` enters
with weight ``1 - t``, the score of the marginal is (Tweedie)::

    grad log p_t(x) = -E[x_0 | x_t = x] / (1 - t) = -(x - t v) / (1 - t)

The SDE family with the ODE's marginals
---------------------------------------
For any ``sigma_t``, ``dx = [v + sigma_t^2 / 2 * grad log p_t] dt + sigma_t dW`` has the marginals of
the probability-flow ODE ``dx = v dt`` (their Fokker-Planck equations agree).  With the score above::

    dx = [v - sigma_t^2 / (2 (1 - t)) (x - t v)] dt + sigma_t dW                     (piRL Eq. 8, our clock)

piRL's ``x + [v + sigma^2 / (2t) (x + (1 - t) v)] dt`` with ``sigma_t = a sqrt(t / (1 - t))`` (Eq. 9) is this
equation under ``t -> 1 - t, v -> -v``: in flowlib's clock ``sigma_t = a sqrt((1 - t) / t)``, infinite at the
noise end.  The guard is RLinf's: the first step (``t = 0``) uses ``t = dt`` in the denominator, so
``sigma_0 = a sqrt(K)`` and its step std ``sigma_0 sqrt(dt) = a``.  One Euler-Maruyama step of size ``dt``
is the Gaussian ``N(mean, sigma_t^2 dt I)``.

Flow-CPS (coefficient-preserving, Wang & Yu 2025, as in RLinf's ``flow_cps``): predict the data
``x_1_hat = x + (1 - t) v`` and the noise ``x_0_hat = x - t v``, then re-mix the noise with fresh noise
at the next time ``s = t + dt``::

    x_s = s x_1_hat + (1 - s) [cos(pi a / 2) x_0_hat + sin(pi a / 2) eps]

so the mean is ``s x_1_hat + (1 - s) cos(pi a / 2) x_0_hat`` and the std ``(1 - s) sin(pi a / 2)``.  The
last step (``s = 1``) has std 0: it is deterministic and never enters a log-probability.

ReinFlow / Flow-Noise: the mean is the Euler step ``x + v dt`` and the std comes from a learned
noise net (``flowlib.flows.nets.ExploreNoiseNet``).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from flowlib._moved import moved_names
from flowlib.flows.distributions import correlated_noise, gaussian_log_prob
from flowlib.flows.models import time_grid

METHODS = ("reinflow", "flow_noise", "flow_sde", "flow_cps")
LEARNED_NOISE = ("reinflow", "flow_noise")


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"noise_method must be one of {METHODS}, got {method!r}")


def _col(t, like: torch.Tensor) -> torch.Tensor:
    """A scalar or ``[B]`` time as a tensor that broadcasts over ``like [B, ...]``."""
    t = torch.as_tensor(t, dtype=like.dtype, device=like.device)
    return t.reshape(-1, *([1] * (like.dim() - 1))) if t.dim() else t


def score_from_velocity(x: torch.Tensor, velocity: torch.Tensor, t) -> torch.Tensor:
    """``grad log p_t(x) = -(x - t v) / (1 - t)`` (Tweedie for the linear path; needs ``t < 1``)."""
    t = _col(t, x)
    return -(x - t * velocity) / (1 - t)


def sde_sigma(t, noise_level: float, dt: float) -> torch.Tensor:
    """``sigma_t = a sqrt((1 - t) / max(t, dt))``: piRL Eq. 9 in flowlib's clock, with RLinf's guard at ``t = 0``."""
    t = torch.as_tensor(t, dtype=torch.float32)
    return noise_level * torch.sqrt((1 - t) / torch.clamp(t, min=dt))


def stochastic_steps(method: str, num_steps: int) -> int:
    """How many of the ``K`` steps can carry noise: all, except Flow-CPS's last (std 0)."""
    check_method(method)
    return num_steps - 1 if method == "flow_cps" else num_steps


def transition(method: str, x: torch.Tensor, velocity: torch.Tensor, t, dt: float, noise_level: float = 0.0,
               noise_std: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of one stochastic denoising step ``p(x_{t+dt} | x_t) = N(mean, std^2)``.

    ``x``, ``velocity``: ``[B, ...]``; ``t``: scalar or ``[B]``.  ``noise_std`` (learned-noise methods)
    must broadcast over ``x``.  The std is returned broadcastable over ``x`` (per sample for the SDE/CPS
    methods).  The deterministic (ODE) step is ``x + v dt`` with std 0.
    """
    check_method(method)
    tt = _col(t, x)
    if method in LEARNED_NOISE:
        if noise_std is None:
            raise ValueError(f"{method} needs noise_std from the noise net")
        return x + velocity * dt, noise_std
    if method == "flow_sde":
        sigma = _col(sde_sigma(t, noise_level, dt).to(x.device, x.dtype), x)
        drift = velocity - sigma ** 2 / (2 * (1 - tt)) * (x - tt * velocity)  # v + sigma^2 / 2 * score
        return x + drift * dt, sigma * math.sqrt(dt)
    s = tt + dt  # flow_cps
    data_hat, noise_hat = x + (1 - tt) * velocity, x - tt * velocity
    angle = math.pi * noise_level / 2
    return s * data_hat + (1 - s) * math.cos(angle) * noise_hat, (1 - s) * math.sin(angle)


def clamp_mean(mean: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``mean [B, ..., A]`` clamped into ``bounds = (low [A], high [A])`` (None: unchanged): a denoising step's
    mean kept inside the action range, as ReinFlow clamps it (``denoised_clip_value``)."""
    return mean if bounds is None else torch.maximum(torch.minimum(mean, bounds[1]), bounds[0])


def hybrid_mask(batch: int, num_steps: int, eligible: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Hybrid ODE-SDE (piRL Sec. 4.3): one stochastic step per sample, uniform over the first ``eligible``
    steps; the rest are ODE steps.  ``[B, K]`` bool with exactly one True per row."""
    if eligible < 1:
        raise ValueError("no denoising step can carry noise (Flow-CPS needs K >= 2)")
    idx = torch.randint(eligible, (batch,), generator=generator)
    return torch.nn.functional.one_hot(idx, num_steps).bool()


def full_mask(batch: int, num_steps: int, eligible: int) -> torch.Tensor:
    """Every step that can carry noise is stochastic: ``[B, K]`` bool."""
    mask = torch.zeros(batch, num_steps, dtype=torch.bool)
    mask[:, :eligible] = True
    return mask


@torch.no_grad()
def sample_chain(velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x0: torch.Tensor, num_steps: int,
                 method: str, noise_level: float = 0.0, stochastic: torch.Tensor | None = None,
                 generator: torch.Generator | None = None,
                 log_prob_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
                 noise_std_fn: Callable[[torch.Tensor], torch.Tensor] | None = None, noise_corr: float = 0.0,
                 mean_bounds: tuple[torch.Tensor, torch.Tensor] | None = None, noise_clip: float = 0.0):
    """Run ``K`` steps on ``flows.time_grid(K)`` from ``x0 [B, ...]``.

    ``velocity_fn(x, t) -> velocity``; ``noise_std_fn(t) -> noise_std`` (learned-noise methods) is called only
    at steps that carry noise.  Steps where ``stochastic [B, K]`` is True draw from ``transition(...)``;
    the others take the ODE step ``x + v dt``.  ``stochastic=None`` is the ODE.
    Returns ``chain [B, K+1, ...]`` and the per-step log-probs ``[B, K]`` (0 at ODE steps):
    ``log_prob_fn(x_next, mean, std, k) -> [B]``, by default ``gaussian_log_prob`` over every dim.
    ``noise_corr``: the noise of a step is correlated along dim 1 (``correlated_noise``); ``log_prob_fn``
    must then score it with the same ``corr``.  ReinFlow's two guards (its ``denoised_clip_value`` and
    ``randn_clip_value``): ``mean_bounds = (low, high)``, each broadcast over the last dim, clamps every stochastic
    step's mean (``clamp_mean``; the scorer must clamp alike), and ``noise_clip > 0`` clips the standard normal draw
    to ``+-noise_clip`` (3: no step lands past 3 sigma; the clipped point is scored under the same Gaussian).
    """
    log_prob_fn = log_prob_fn or (lambda x_next, mean, std, k: gaussian_log_prob(x_next, mean, std, noise_corr))
    B, K, dt = x0.shape[0], num_steps, 1.0 / num_steps
    grid = time_grid(K, x0.device)
    mask = torch.zeros(B, K, dtype=torch.bool) if stochastic is None else stochastic
    if mask.shape != (B, K):
        raise ValueError(f"stochastic must be [B, K] = [{B}, {K}], got {tuple(mask.shape)}")
    mask = mask.to(x0.device)
    x, chain, log_probs = x0, [x0], torch.zeros(B, K, device=x0.device)
    for k in range(K):
        t = grid[k].expand(B)
        velocity = velocity_fn(x, t)
        ode = x + velocity * dt
        if mask[:, k].any():
            noise_std = noise_std_fn(t) if noise_std_fn is not None else None
            mean, std = transition(method, x, velocity, t, dt, noise_level, noise_std)
            mean = clamp_mean(mean, mean_bounds)
            eps = correlated_noise(x.shape, noise_corr, generator).to(x.device)
            if noise_clip > 0:
                eps = eps.clamp(-noise_clip, noise_clip)
            noisy = mean + std * eps
            std = torch.as_tensor(std, dtype=x.dtype, device=x.device).expand_as(x)
            lp = log_prob_fn(noisy, mean, std, k)
            log_probs[:, k] = torch.where(mask[:, k], lp, 0.0)
            x = torch.where(mask[:, k].reshape(-1, *([1] * (x.dim() - 1))), noisy, ode)
        else:
            x = ode
        chain.append(x)
    return torch.stack(chain, 1), log_probs


# what moved to flowlib.flows.distributions (2026-12-07): old imports still work, with a warning
__getattr__ = moved_names(__name__, {"gaussian_entropy": "flowlib.flows.distributions",
                                     "LOG_2PI": "flowlib.flows.distributions"})
