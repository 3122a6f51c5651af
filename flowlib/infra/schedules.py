"""Schedules over training progress ``p`` in [0, 1], defined once: the learning rates' multiplier (stage 1's warm-up
then cosine, stage 3's cosine to a floor) and stage 3's exploration-noise bound."""
from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")
NOISE_SCHEDULES = ("constant", "linear", "exp")


def lr_factor(kind: str, progress: float, min_ratio: float = 0.0) -> float:
    """The learning rates' multiplier at training ``progress``: constant 1, or (``"cosine"``, ReinFlow's
    ``CosineAnnealingWarmupRestarts`` without restarts) ``r + (1 - r) (1 + cos(pi p)) / 2``, ``r = min_ratio``
    (0: down to zero, stage 1's cosine)."""
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        p = min(max(progress, 0.0), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {kind!r}")


def warmup_then(kind: str, step: int, warmup_steps: int, total_steps: int) -> float:
    """Stage 1's multiplier at optimiser ``step``: linear warm-up to 1 over ``warmup_steps``, then ``lr_factor(kind)``
    over the remaining steps (cosine: down to zero at ``total_steps``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return lr_factor(kind, (step - warmup_steps) / max(1, total_steps - warmup_steps))


def noise_schedule(kind: str, progress: float, init: float, final: float) -> float:
    """The exploration std's upper bound at training ``progress`` (ReinFlow's decaying exploration).

    constant: ``init``; linear: ``init + (final - init) p``; exp: ``final + (init - final) exp(-3p)``.
    """
    p = min(max(progress, 0.0), 1.0)
    if kind == "constant":
        return init
    if kind == "linear":
        return init + (final - init) * p
    if kind == "exp":
        return final + (init - final) * math.exp(-3.0 * p)
    raise ValueError(f"noise schedule must be one of {NOISE_SCHEDULES}, got {kind!r}")
