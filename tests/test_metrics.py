"""Sliced Wasserstein distance against closed forms."""
import math

import pytest
import torch

from flowlib.metrics import sliced_wasserstein
from flowlib.toy2d import TARGETS, sample_target


def test_identical_sets_are_at_distance_zero():
    x = torch.randn(500, 2)
    assert sliced_wasserstein(x, x.clone()) == pytest.approx(0.0, abs=1e-12)


def test_a_shift_gives_its_length_over_sqrt_dim():
    """Shifting by delta moves every 1D projection by theta . delta: SW_2 = |delta| sqrt(E (theta.e)^2) = |delta| / sqrt(D)."""
    x = torch.randn(1000, 2)
    delta = torch.tensor([3.0, 4.0])
    assert sliced_wasserstein(x, x + delta, num_projections=4096) == pytest.approx(5 / math.sqrt(2), rel=0.03)


def test_different_sizes_and_sample_noise():
    a, b = sample_target("two_moons", 4000, seed=1), sample_target("two_moons", 3000, seed=2)
    far = sample_target("checkerboard", 4000, seed=3)
    assert sliced_wasserstein(a, b) < 0.1 < sliced_wasserstein(a, far)


def test_bad_shapes_and_nan():
    with pytest.raises(ValueError, match="same D"):
        sliced_wasserstein(torch.randn(5, 2), torch.randn(5, 3))
    x = torch.randn(5, 2)
    x[0, 0] = float("nan")
    assert sliced_wasserstein(x, torch.randn(5, 2)) == float("inf")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_targets_are_seeded_and_unit_scale(name):
    a, b = sample_target(name, 2000, seed=0), sample_target(name, 2000, seed=0)
    assert torch.equal(a, b) and a.shape == (2000, 2)
    assert 0.3 < a.std(0).min() and a.abs().max() < 4
    with pytest.raises(ValueError, match="unknown 2D target"):
        sample_target("spiral", 10)
