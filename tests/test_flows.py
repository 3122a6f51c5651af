"""Flow models: targets against closed forms and finite differences, sampling, losses."""

import pytest
import torch
import torch.nn as nn

from flowlib.flows.models import MeanFlow, ReFlow, ShortCut, interpolate, time_grid
from flowlib.flows.nets import ConditionalMLP


@pytest.fixture(autouse=True)
def float64():
    """These closed-form checks run in float64; the default dtype is restored for other test files."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# Gaussian-to-Gaussian: x_0 ~ N(0, I), x_1 ~ N(m, s^2 I).  Then x_t ~ N(t m, sig_t^2 I) with
# sig_t^2 = (1 - t)^2 + t^2 s^2, the marginal flow is affine, and v and u have closed forms.
M, S = torch.tensor([2.0, -1.0], dtype=torch.float64), 0.5


def sig(t):
    return torch.sqrt((1 - t) ** 2 + (t * S) ** 2)


def exact_flow_map(x, t, s):
    """x_t -> x_s along the marginal ODE: x_s = s m + sig_s / sig_t (x_t - t m)."""
    t_, s_ = t[:, None], s[:, None]
    return s_ * M + (sig(s) / sig(t))[:, None] * (x - t_ * M)


def exact_velocity(x, t):
    """v(x, t) = m + sig_t'/sig_t (x - t m), sig_t' sig_t = -(1 - t) + t s^2."""
    rate = (-(1 - t) + t * S**2) / sig(t) ** 2
    return M + rate[:, None] * (x - t[:, None] * M)


class ExactAverageVelocity(nn.Module):
    """u(x, t, t + d) = (x_{t+d} - x_t) / d; at d = 0, the instantaneous velocity."""

    def forward(self, x, t, d, obs=None):
        small = d < 1e-9
        d_safe = torch.where(small, torch.ones_like(d), d)
        u = (exact_flow_map(x, t, t + d_safe) - x) / d_safe[:, None]
        return torch.where(small[:, None], exact_velocity(x, t), u)


class ExactVelocity(nn.Module):
    def forward(self, x, t, d, obs=None):
        return exact_velocity(x, t)


def test_time_grid_is_one_grid_from_noise_to_data():
    g = time_grid(4)
    assert torch.allclose(g, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    with pytest.raises(ValueError):
        time_grid(0)


def test_interpolation_endpoints_follow_convention():
    x0, x1 = torch.zeros(3, 2), torch.ones(3, 2)
    assert torch.equal(interpolate(x0, x1, torch.zeros(3)), x0)  # t = 0 is noise
    assert torch.equal(interpolate(x0, x1, torch.ones(3)), x1)  # t = 1 is data


def test_reflow_sampler_with_exact_velocity_reaches_the_target_gaussian():
    model = ReFlow(ExactVelocity())
    x = model.sample(torch.randn(20000, 2, generator=torch.Generator().manual_seed(0)), num_steps=200)
    assert torch.allclose(x.mean(0), M, atol=0.02)
    assert torch.allclose(x.std(0), torch.full((2,), S), atol=0.02)


def test_meanflow_target_equals_exact_average_velocity():
    """With the true u and v, u_tgt = v + (s - t) du/dt reproduces u (MeanFlow Eq. 6, time-flipped)."""
    model = MeanFlow(ExactAverageVelocity())
    n = 64
    g = torch.Generator().manual_seed(1)
    t = 0.8 * torch.rand(n, generator=g)
    s = t + (1 - t) * torch.rand(n, generator=g)
    x = t[:, None] * M + sig(t)[:, None] * torch.randn(n, 2, generator=g)
    u, u_tgt = model.target(x, t, s, exact_velocity(x, t))
    assert torch.allclose(u, u_tgt, atol=1e-8)
    # and the sign matters: the un-flipped identity u = v - (s - t) du/dt does not hold
    _, dudt = torch.func.jvp(lambda x_, t_, s_: model.mean_velocity(x_, t_, s_), (x, t, s),
                             (exact_velocity(x, t), torch.ones_like(t), torch.zeros_like(s)))
    assert not torch.allclose(u, exact_velocity(x, t) - (s - t)[:, None] * dudt, atol=1e-3)


def test_meanflow_jvp_matches_finite_differences():
    torch.manual_seed(0)
    net = ConditionalMLP(dim=2, hidden=32, depth=2)
    model = MeanFlow(net)
    n, eps = 16, 1e-6
    x, v = torch.randn(n, 2), torch.randn(n, 2)
    t = 0.5 * torch.rand(n)
    s = t + 0.3
    _, u_tgt = model.target(x, t, s, v)
    with torch.no_grad():
        fd = (model.mean_velocity(x + eps * v, t + eps, s) - model.mean_velocity(x - eps * v, t - eps, s)) / (2 * eps)
    assert torch.allclose(u_tgt, v + (s - t)[:, None] * fd, atol=1e-6)


def test_meanflow_one_step_with_exact_average_velocity_is_exact():
    model = MeanFlow(ExactAverageVelocity())
    x = model.sample(torch.randn(20000, 2, generator=torch.Generator().manual_seed(0)), num_steps=1)
    assert torch.allclose(x.mean(0), M, atol=0.02)
    assert torch.allclose(x.std(0), torch.full((2,), S), atol=0.02)


def test_meanflow_time_pairs_are_ordered_with_the_configured_share_distinct():
    model = MeanFlow(ExactAverageVelocity())
    torch.manual_seed(0)
    t, s = model.sample_times(20000)
    assert (s >= t).all() and (t >= 0).all() and (s <= 1).all()
    assert abs((s != t).double().mean().item() - 0.25) < 0.02


def test_shortcut_consistency_target_is_the_mean_of_two_half_steps():
    model = ShortCut(ExactVelocity(), ema_decay=None)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(8, 2, generator=g), torch.full((8,), 0.25)
    d = torch.full((8,), 0.125)
    v1 = exact_velocity(x, t)
    v2 = exact_velocity(x + 0.125 * v1, t + 0.125)
    assert torch.allclose(model.consistency_target(x, t, d), 0.5 * (v1 + v2))


def test_shortcut_bootstrap_times_stay_on_the_grid_of_their_step():
    model = ShortCut(ExactVelocity(), ema_decay=None, max_steps=16)
    torch.manual_seed(0)
    t, d = model.sample_bootstrap_times(5000)
    assert set(d.unique().tolist()) == {0.5, 0.25, 0.125, 0.0625}
    assert (t + 2 * d <= 1 + 1e-12).all()
    k = t / (2 * d)
    assert torch.allclose(k, k.round())


def test_shortcut_rejects_more_steps_than_it_was_trained_for():
    model = ShortCut(ExactVelocity(), ema_decay=None, max_steps=8)
    with pytest.raises(ValueError, match="max_steps=8"):
        model.sample(torch.randn(4, 2), num_steps=16)


@pytest.mark.parametrize("cls", [ReFlow, MeanFlow, ShortCut])
def test_weighted_loss_with_equal_weights_equals_unweighted(cls):
    torch.manual_seed(0)
    model = cls(ConditionalMLP(dim=2, hidden=16, depth=1))
    x1 = torch.randn(32, 2)
    torch.manual_seed(1)
    plain, _ = model.loss(x1)
    torch.manual_seed(1)
    weighted, _ = model.loss(x1, weight=torch.ones(32))
    assert torch.allclose(plain, weighted)
    torch.manual_seed(1)
    doubled, _ = model.loss(x1, weight=torch.full((32,), 2.0))
    assert torch.allclose(doubled, 2 * plain)
    with pytest.raises(ValueError, match="one per sample"):
        model.loss(x1, weight=torch.ones(31))


@pytest.mark.parametrize("cls", [ReFlow, MeanFlow, ShortCut])
def test_nan_in_the_batch_is_rejected(cls):
    model = cls(ConditionalMLP(dim=2, hidden=16, depth=1))
    x1 = torch.randn(8, 2)
    x1[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        model.loss(x1)


@pytest.mark.parametrize("cls", [ReFlow, MeanFlow, ShortCut])
def test_trained_instantaneous_velocity_matches_the_exact_gaussian_velocity(cls):
    """Trained on N(m, s^2) data, the net at its smallest jump learns v(x, t) = m + sig_t'/sig_t (x - t m).

    The smallest jump is d = 0 for ReFlow and MeanFlow, d_min for ShortCut (its flow-matching level).
    """
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(0)
        model = cls(ConditionalMLP(dim=2, hidden=64, depth=2), ema_decay=0.99)
        opt = torch.optim.Adam(model.net.parameters(), lr=2e-3)
        g = torch.Generator().manual_seed(123)
        t = 0.05 + 0.9 * torch.rand(512, generator=g)
        xt = t[:, None] * M.float() + sig(t)[:, None] * torch.randn(512, 2, generator=g)
        v_exact = exact_velocity(xt, t)

        d = torch.full_like(t, model.d_min if isinstance(model, ShortCut) else 0.0)

        def error():
            with torch.no_grad():
                return ((model.net(xt, t, d) - v_exact) ** 2).sum(1).mean().item()

        before = error()
        for _ in range(400):
            loss, _ = model.loss(M.float() + S * torch.randn(256, 2))
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.update_ema()
        after = error()
        assert after < 0.05 * (v_exact ** 2).sum(1).mean().item(), (before, after)
    finally:
        torch.set_default_dtype(torch.float64)  # back to this module's dtype


def test_ema_tracks_the_live_net():
    torch.manual_seed(0)
    model = ReFlow(ConditionalMLP(dim=2, hidden=8, depth=1), ema_decay=0.5)
    model.update_ema()  # first update copies
    with torch.no_grad():
        for p in model.net.parameters():
            p.add_(1.0)
    model.update_ema()
    for p, q in zip(model.net.parameters(), model.ema.module.parameters()):
        assert torch.allclose(q, p - 0.5)
    assert not any(p.requires_grad for p in model.ema.parameters())


def test_net_rejects_missing_or_unexpected_observation():
    net = ConditionalMLP(dim=2, obs_dim=3, hidden=8, depth=1)
    x, t = torch.randn(4, 2), torch.rand(4)
    assert net(x, t, t, torch.randn(4, 3)).shape == (4, 2)
    with pytest.raises(ValueError, match="pass obs"):
        net(x, t, t)
    with pytest.raises(ValueError, match="obs_dim=0"):
        ConditionalMLP(dim=2, hidden=8, depth=1)(x, t, t, torch.randn(4, 3))


def test_a_diverging_2d_fit_stops_with_the_step_and_the_fix():
    from flowlib.flows.toy2d import Flows2DConfig, build_model, train_2d
    cfg = Flows2DConfig(train_steps=50, lr=1e30, hidden=16, depth=2)
    with pytest.raises(FloatingPointError, match=r"two_moons ReFlow loss is (nan|inf) at step \d+: lower lr"):
        train_2d(build_model("reflow", cfg), "two_moons", cfg)


def test_adopt_ema_makes_the_live_net_sample_as_the_ema_does():
    torch.manual_seed(0)
    model = ShortCut(ConditionalMLP(dim=2, hidden=8, depth=1), ema_decay=0.9)
    with torch.no_grad():
        for p in model.net.parameters():
            p.add_(0.3)  # the live net drifts from its EMA
    noise = torch.randn(16, 2)
    assert not torch.allclose(model.sample(noise, 4, use_ema=False), model.sample(noise, 4, use_ema=True))
    model.adopt_ema()
    assert torch.allclose(model.sample(noise, 4, use_ema=False), model.sample(noise, 4, use_ema=True))
