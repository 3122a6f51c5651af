"""Sliced Wasserstein distance and success-rate standard errors against closed forms."""
import math

import pytest
import torch

from flowlib.flows.toy2d import TARGETS, sample_target
from flowlib.infra.metrics import paired_means, sliced_wasserstein, success_rates


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


def test_success_rates_pair_the_episodes():
    """x = [1, 1, 0, 0] against r = [1, 0, 0, 0]: p = 0.5, SE sqrt(.25 / 4) = 0.25; d = [0, 1, 0, 0], mean 0.25,
    std (ddof 1) 0.5, SE 0.25.  A policy that solves the same episodes as the reference has a paired SE of 0."""
    rows = success_rates({"ref": [1, 0, 0, 0], "new": [1, 1, 0, 0], "same": [True, False, False, False]})
    ref, new, same = rows
    assert ref["diff"] == 0 and ref["diff_se"] == 0 and ref["success"] == 0.25
    assert new["success"] == 0.5 and new["se"] == pytest.approx(0.25)
    assert new["diff"] == pytest.approx(0.25) and new["diff_se"] == pytest.approx(0.25)
    assert same["diff_se"] == 0 and same["se"] > 0


def test_success_rates_need_the_same_episodes():
    with pytest.raises(ValueError, match="same >= 2 episodes"):
        success_rates({"a": [1, 0, 1], "b": [1, 0]})
    with pytest.raises(ValueError, match="at least one policy"):
        success_rates({})


def test_paired_means_cancel_what_the_episodes_share():
    """Returns that differ a lot between episodes but by a constant 2 between policies: each mean has a large
    SE, the paired difference is exactly 2 with SE 0."""
    ref = [10.0, 40.0, 25.0, 5.0]
    rows = paired_means({"ref": ref, "better": [r + 2 for r in ref]})
    assert rows[1]["mean"] == pytest.approx(22.0) and rows[1]["se"] > 7
    assert rows[1]["diff"] == pytest.approx(2.0) and rows[1]["diff_se"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="same >= 2 episodes"):
        paired_means({"a": [1.0, 2.0], "b": [1.0]})
