"""Diagonal and chunk-correlated Gaussians: the density every stochastic policy here scores its draws with.

A denoising step of the noisy chain (``flowlib.flows.flow_sde``), DSRL's policy over ``x_0``, a residual and the
Gaussian baseline are all Gaussian given what they condition on; their log-probs and entropies are these.
"""
from __future__ import annotations

import math

import torch

LOG_2PI = math.log(2 * math.pi)


def gaussian_entropy(std: torch.Tensor) -> torch.Tensor:
    """Mean entropy per dim of a diagonal Gaussian, ``[B, ...]`` std -> ``[B]``: ``1/2 (1 + log 2 pi) + log std``
    averaged over the dims (the mean does not enter)."""
    return (0.5 * (1 + LOG_2PI) + torch.log(std)).flatten(1).mean(1)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, corr: float = 0.0) -> torch.Tensor:
    """``sum log N(x; mean, std^2)`` over every non-batch dim: ``[B, ...] -> [B]``.

    With ``corr = rho`` in ``[0, 1)`` the noise is equicorrelated along dim 1 (a chunk's ``n`` time steps):
    per remaining index, ``Cov = S C S`` with ``S = diag(std)`` and ``C = (1 - rho) I + rho 1 1^T``, so with
    ``z = (x - mean) / std`` (Sherman-Morrison for ``C^-1``, the matrix determinant lemma for ``det C``)::

        log p = -1/2 [ (|z|^2 - rho / (1 - rho + n rho) (sum_h z_h)^2) / (1 - rho)
                       + (n - 1) log(1 - rho) + log(1 - rho + n rho) ] - sum_h log std_h - n/2 log(2 pi)
    """
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device).expand_as(x)
    z = (x - mean) / std
    if not corr:
        return (-0.5 * z.pow(2) - torch.log(std) - 0.5 * LOG_2PI).flatten(1).sum(1)
    if not 0 <= corr < 1 or x.dim() < 3:
        raise ValueError(f"corr must be in [0, 1) and x [B, n, ...], got {corr} and {tuple(x.shape)}")
    n, rho = x.shape[1], corr
    quad = (z.pow(2).sum(1) - rho / (1 - rho + n * rho) * z.sum(1).pow(2)) / (1 - rho)        # [B, ...]
    log_det_c = (n - 1) * math.log(1 - rho) + math.log(1 - rho + n * rho)
    return (-0.5 * (quad + log_det_c)).flatten(1).sum(1) - (torch.log(std) + 0.5 * LOG_2PI).flatten(1).sum(1)


def correlated_noise(shape, corr: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """``eps ~ N(0, C)`` with ``C = (1 - corr) I + corr 1 1^T`` along dim 1 (``gaussian_log_prob``'s ``corr``):
    ``sqrt(1 - corr) z + sqrt(corr) z_shared``, one ``z_shared`` per chunk and action dim."""
    eps = torch.randn(shape, generator=generator)
    if corr:
        shared = torch.randn(shape[0], 1, *shape[2:], generator=generator)
        eps = math.sqrt(1 - corr) * eps + math.sqrt(corr) * shared
    return eps
