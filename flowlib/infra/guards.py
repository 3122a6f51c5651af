"""Run guards: a training step whose loss or gradient is NaN or inf stops the run before the optimiser applies it.

A non-finite gradient clipped by ``clip_grad_norm_`` turns every weight into NaN, and the run then logs NaN and
writes NaN checkpoints for as long as it is left running. Each training loop checks the number it already has
(the loss, or the total gradient norm that clipping returns) and raises with the step, what went wrong and the
fix; the weights in memory and the last checkpoint are still the ones from before the bad step.
"""
from __future__ import annotations

import math

import torch


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm is NaN or inf."""


def require_finite(value: torch.Tensor | float, what: str, at: str, fix: str) -> None:
    """Raise ``NonFiniteError`` when ``value`` (a scalar) is NaN or inf, naming ``what``, where (``at``: "step 12")
    and the ``fix``."""
    number = float(value.detach() if isinstance(value, torch.Tensor) else value)
    if not math.isfinite(number):
        raise NonFiniteError(f"{what} is {number} at {at}: {fix}. Nothing from this step was applied; "
                             "the last checkpoint holds the weights from before it")
