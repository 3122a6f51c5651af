"""Distances between sample sets; success rates and other per-episode means with paired standard errors."""
from __future__ import annotations

import numpy as np
import torch


def sliced_wasserstein(x: torch.Tensor, y: torch.Tensor, num_projections: int = 512, seed: int = 0) -> float:
    """Sliced 2-Wasserstein distance between two point clouds ``[N, D]`` and ``[M, D]``.

    ``SW_2(x, y) = ( E_theta W_2^2(theta.x, theta.y) )^(1/2)`` over directions ``theta`` uniform
    on the sphere (Bonneel et al. 2015, Eq. 10); each 1D ``W_2`` compares sorted projections
    (quantiles at ``min(N, M)`` levels when the sizes differ).  Projections come from a fixed
    seed, so the same inputs always give the same number.
    """
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"expected [N, D] and [M, D] with the same D, got {tuple(x.shape)} and {tuple(y.shape)}")
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        return float("inf")
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(x.shape[1], num_projections, generator=g, dtype=torch.float64)
    theta = theta / theta.norm(dim=0, keepdim=True)
    px = (x.double().cpu() @ theta).sort(dim=0).values  # [N, P]
    py = (y.double().cpu() @ theta).sort(dim=0).values  # [M, P]
    if px.shape[0] != py.shape[0]:
        n = min(px.shape[0], py.shape[0])
        q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        px, py = _quantiles(px, q), _quantiles(py, q)
    return ((px - py) ** 2).mean().sqrt().item()


def _quantiles(sorted_cols: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Linear-interpolated quantiles ``q`` of each column of an already sorted ``[N, P]``."""
    n = sorted_cols.shape[0]
    pos = q * (n - 1)
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=n - 1)
    frac = (pos - lo)[:, None]
    return sorted_cols[lo] * (1 - frac) + sorted_cols[hi] * frac


def paired_means(per_episode: dict[str, list[float]]) -> list[dict[str, float | str | int]]:
    """Mean and its standard error per policy, and each one's paired difference from the first.

    All policies must have run the same episodes (same env seeds and policy noise, as
    ``flowlib.policies.bc.evaluate`` arranges).  The mean has SE ``std(x, ddof=1) / sqrt(n)``; the difference from
    the first policy is the mean of the per-episode differences ``d_i = x_i - r_i``, with SE
    ``std(d, ddof=1) / sqrt(n)``: pairing removes what both policies share on an episode (its start, its
    noise), so it is tighter than comparing two independent means.
    """
    names = list(per_episode)
    if not names:
        raise ValueError("paired means need at least one policy")
    table = {name: np.asarray(per_episode[name], dtype=float) for name in names}
    n = len(table[names[0]])
    if n < 2 or any(len(x) != n for x in table.values()):
        raise ValueError(f"every policy needs the same >= 2 episodes, got {[len(x) for x in table.values()]}; "
                         "evaluate them all with the same num_episodes and seed")
    ref = table[names[0]]
    return [{"policy": name, "episodes": n, "mean": float(x.mean()), "se": float(x.std(ddof=1) / np.sqrt(n)),
             "diff": float((x - ref).mean()), "diff_se": float((x - ref).std(ddof=1) / np.sqrt(n))}
            for name, x in table.items()]


def success_rates(per_episode: dict[str, list[bool]]) -> list[dict[str, float | str | int]]:
    """Success rate and its standard error per policy, and each one's paired difference from the first
    (``paired_means``).  Rate ``p`` has the binomial SE ``sqrt(p (1 - p) / n)``."""
    rows = []
    for row in paired_means(per_episode):
        p, n = row["mean"], row["episodes"]
        rows.append({"policy": row["policy"], "episodes": n, "success": p, "se": float(np.sqrt(p * (1 - p) / n)),
                     "diff": row["diff"], "diff_se": row["diff_se"]})
    return rows


def clustered_mean(x, clusters) -> tuple[float, float]:
    """Mean of ``x`` and its standard error with the samples grouped in ``clusters``: the cluster-robust variance of
    a regression on a constant, with the ``C / (C - 1)`` small-sample factor (Cameron & Miller 2015, "A
    Practitioner's Guide to Cluster-Robust Inference").

    Samples of one cluster may be correlated, samples of different clusters are not: several seeds of a policy
    scored on the same env seeds fail and succeed on the same hard episodes, so pooling them into one binomial
    rate over seeds x episodes would understate its error.  With residuals ``e_i = x_i - mean`` and ``C``
    clusters, ``SE^2 = C / (C - 1) * sum_c (sum_{i in c} e_i)^2 / N^2``.  All clusters of size one: the usual
    ``std(x, ddof=1) / sqrt(N)``; ``S`` samples in each of ``C`` clusters: ``std(cluster means, ddof=1) / sqrt(C)``,
    so ``S`` identical copies of one seed's outcomes have that seed's SE, not ``1 / sqrt(S)`` of it.
    """
    x = np.asarray(x, dtype=float)
    clusters = np.asarray(clusters)
    if x.ndim != 1 or clusters.shape != x.shape:
        raise ValueError(f"x and clusters must be 1-D of one length, got shapes {x.shape} and {clusters.shape}")
    labels, which = np.unique(clusters, return_inverse=True)
    C = len(labels)
    if C < 2:
        raise ValueError(f"a clustered standard error needs at least 2 clusters, got {C}")
    mean = float(x.mean())
    sums = np.bincount(which, weights=x - mean)  # [C]  sum of the residuals in each cluster
    return mean, float(np.sqrt(C / (C - 1) * (sums ** 2).sum()) / len(x))


def before_after(results: dict[str, dict]) -> list[dict]:
    """One row per named ``bc.evaluate`` result (``{"before": ..., "after": ...}``): success_once, success_at_end,
    return, and how often each of the task's other flags was true at some step (where failures stop)."""
    return [{"policy": name, **{k: r[k] for k in ("success_once", "success_at_end", "return")},
             **{f"{flag}_once": rate for flag, rate in r["flags_once"].items()}} for name, r in results.items()]
