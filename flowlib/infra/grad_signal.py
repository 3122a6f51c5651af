"""How much of a stochastic gradient is signal: from independent estimates, the squared norm of their mean and the
noise around it, and what they imply for the cosine between two batches' gradients (``benchmarks/gradient_snr.py``
measures it on the policy gradients of stage-3 checkpoints).
"""
from __future__ import annotations

import torch


def gradient_signal(grads: torch.Tensor) -> dict[str, float]:
    """Signal and noise of a stochastic gradient from ``n`` independent estimates ``grads [n, P]``.

    Row ``j`` is ``G_j = mu + e_j`` with ``E e_j = 0`` and ``E |e_j|^2 = s`` (the trace of its covariance).
    With the Gram matrix ``M = G G^T``, ``E M_ij = |mu|^2`` for ``i != j`` and ``E M_jj = |mu|^2 + s``, so

        signal = |mu|^2 ~ mean_{i != j} M_ij   (unbiased),        noise = s ~ mean_j M_jj - signal.

    The mean of ``m`` rows has signal-to-noise ``signal / (noise / m)``; two independent such means meet at a
    cosine of about ``signal / (signal + noise / m)`` (``expected_cosine``), which is 1/2 at
    ``m = noise / signal`` rows (``rows_for_half``; infinite when no signal is detected).  ``signal_se`` is
    the jackknife standard error over rows (leave one row out).  A signal within 2 SE of 0 is not
    ``detected``; ``signal_bound`` is then its upper bound ``max(signal, 0) + 2 SE`` (else the signal itself),
    which turns cosines into upper bounds and ``noise / signal_bound`` into a lower bound on the rows.
    """
    if grads.dim() != 2:
        raise ValueError(f"grads must be [n, P], got {tuple(grads.shape)}")
    return gram_signal(grads @ grads.T)  # [n, n] in the rows' dtype: no float64 copy of [n, P]


def gram_signal(gram: torch.Tensor) -> dict[str, float]:
    """``gradient_signal`` from the Gram matrix ``[n, n]`` of the estimates.  Gram matrices of disjoint
    parameter groups add up to the whole net's, so one set of rows gives every group and their union."""
    n = gram.shape[0]
    if gram.shape != (n, n) or n < 3:
        raise ValueError(f"need n >= 3 independent gradient estimates (a Gram matrix [n, n]), got {tuple(gram.shape)}")
    gram = gram.double()
    diag = gram.diagonal()
    row_off = gram.sum(1) - diag                                           # [n]  sum_{j != i} M_ij
    total_off = row_off.sum()
    signal = total_off / (n * (n - 1))
    loo = (total_off - 2 * row_off) / ((n - 1) * (n - 2))                  # [n]  signal without row i
    signal_se = ((n - 1) / n * ((loo - loo.mean()) ** 2).sum()).sqrt()
    noise = diag.mean() - signal
    detected = bool(signal > 2 * signal_se)
    bound = signal if detected else signal.clamp(min=0) + 2 * signal_se
    return {"n": n, "signal": float(signal), "signal_se": float(signal_se), "noise": float(noise),
            "rows_for_half": float(noise / signal) if signal > 0 else float("inf"),
            "detected": detected, "signal_bound": float(bound)}


def expected_cosine(signal: float, noise: float, m: float) -> float:
    """Expected cosine between two independent means of ``m`` gradient estimates (``gradient_signal``)."""
    return 0.0 if signal <= 0 else signal / (signal + noise / m)
