"""Flow-SDE / Flow-CPS / Flow-Noise (piRL): the transitions against the papers' own formulas, the
ODE limit, hybrid masks, the score identity, and the SDE's marginals against the ODE's in 2D."""
import math

import pytest
import torch
from test_reinflow import ACT_DIM, tiny_policy

from flowlib.flows import distributions, flow_sde
from flowlib.flows.toy2d import eight_gaussian_means, mixture_velocity
from flowlib.infra.metrics import sliced_wasserstein
from flowlib.methods import reinflow_agent, stage3


def pirl_transition(method, x, v, t, dt, a):
    """piRL / RLinf formulas in *their* clock (tau = 1 - t is the noise level, u = -v, steps go tau -> tau - dt)."""
    tau, u = 1 - t, -v
    if method == "flow_sde":
        timesteps = torch.linspace(1, dt, round(1 / dt))
        denom = 1 - torch.where(torch.tensor(tau) == 1, timesteps[1], torch.tensor(tau))
        sigma = a * math.sqrt(tau / float(denom))
        mean = x + (u + sigma ** 2 / (2 * tau) * (x + (1 - tau) * u)) * (-dt)           # Eq. 8, dt < 0
        return mean, sigma * math.sqrt(dt)
    x0_pred, x1_pred = x - u * tau, x + u * (1 - tau)                                     # data, noise
    nxt = tau - dt
    mean = x0_pred * (1 - nxt) + x1_pred * nxt * math.cos(math.pi * a / 2)
    return mean, nxt * math.sin(math.pi * a / 2)


def agent_for(method, K=4, hybrid=False, **kw):
    policy, dataset = tiny_policy()
    agent = reinflow_agent.ReinFlowAgent(policy, K, min_noise_std=0.05, max_noise_std=0.3, value_hidden_dims=(16,),
                                         noise_hidden=16, noise_method=method, noise_level=0.7, hybrid=hybrid, **kw)
    obs = torch.stack([dataset[i][0] for i in range(6)])
    return agent, obs


@pytest.mark.parametrize("method", flow_sde.METHODS)
@pytest.mark.parametrize("hybrid", [False, True])
def test_each_methods_log_prob_equals_a_direct_gaussian_computation(method, hybrid):
    agent, obs = agent_for(method, hybrid=hybrid)
    chain, log_prob, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(0), return_steps=True)
    o = agent.obs_normalizer.normalize(obs)
    K, dt = 4, 0.25
    expected = torch.zeros(6, dtype=torch.float64)
    if method == "flow_noise":  # Flow-Noise's joint log-prob includes the initial noise
        expected += torch.distributions.Normal(0.0, 1.0).log_prob(chain[:, 0].double()).flatten(1).sum(1)
    with torch.no_grad():
        for k in range(K):
            t = k / K
            tt = torch.full((6,), t)
            v = agent.actor.base(chain[:, k], tt, torch.full((6,), dt), o)
            if method in ("reinflow", "flow_noise"):
                mean = chain[:, k] + dt * v
                std = agent.actor.noise_net(tt, o.flatten(1))[:, None, :].expand_as(v)
            else:
                mean, std = pirl_transition(method, chain[:, k], v, t, dt, 0.7)
                std = torch.full_like(v, std)
            if not stochastic[:, k].any():
                assert torch.allclose(chain[:, k + 1], chain[:, k] + dt * v, atol=1e-5)  # ODE steps
                continue
            lp = torch.distributions.Normal(mean.double(), std.double()).log_prob(chain[:, k + 1].double()).flatten(1).sum(1)
            expected += torch.where(stochastic[:, k], lp, 0.0)
            ode_rows = ~stochastic[:, k]
            assert torch.allclose(chain[ode_rows, k + 1], chain[ode_rows, k] + dt * v[ode_rows], atol=1e-5)
    assert torch.allclose(log_prob.double(), expected, rtol=1e-4, atol=1e-2)
    with torch.no_grad():
        rescored, _ = agent.log_prob(obs, chain, stochastic)
    assert torch.allclose(rescored, log_prob, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("method", ["flow_sde", "flow_cps"])
def test_noise_level_zero_reduces_to_the_ode_step(method):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(8, 16, ACT_DIM, generator=g), torch.randn(8, 16, ACT_DIM, generator=g)
    for t in (0.0, 0.25, 0.5, 0.75):
        mean, std = flow_sde.transition(method, x, v, t, 0.25, noise_level=0.0)
        assert torch.allclose(mean, x + 0.25 * v, atol=1e-6) and float(torch.as_tensor(std).abs().max()) == 0.0
        mean, std = flow_sde.transition(method, x, v, t, 0.25, noise_level=1e-3)
        last_cps = method == "flow_cps" and t == 0.75  # its std is 0 at any a: never stochastic
        assert torch.allclose(mean, x + 0.25 * v, atol=1e-4)
        assert (float(torch.as_tensor(std).max()) == 0) if last_cps else (0 < float(torch.as_tensor(std).max()) < 2e-3)


def test_hybrid_mode_marks_exactly_one_stochastic_step_per_sample():
    for method, eligible in (("flow_sde", 4), ("flow_cps", 3)):
        agent, obs = agent_for(method, hybrid=True)
        _, _, stochastic, step_lp = agent.sample(obs.repeat(20, 1, 1), torch.Generator().manual_seed(1),
                                                 return_steps=True)
        assert (stochastic.sum(1) == 1).all()
        assert set(stochastic.float().argmax(1).tolist()) == set(range(eligible))  # never CPS's last step
        assert (step_lp[~stochastic] == 0).all() and (step_lp[stochastic] != 0).all()


def test_cps_needs_a_stochastic_step_and_unknown_methods_are_rejected():
    with pytest.raises(ValueError, match="no stochastic step"):
        agent_for("flow_cps", K=1)
    with pytest.raises(ValueError, match="noise_method must be one of"):
        agent_for("flow_ddim")
    with pytest.raises(ValueError, match="ratio_mode"):
        stage3.Stage3Config(ratio_mode="layered")


def test_score_from_velocity_matches_the_closed_form_of_a_gaussian():
    mu, std = torch.tensor([[1.5, -0.5]]), 0.3
    x, t = torch.randn(100, 2), torch.rand(100) * 0.95
    v = mixture_velocity(x, t, mu, std)
    var = ((1 - t) ** 2 + t ** 2 * std ** 2)[:, None]
    assert torch.allclose(flow_sde.score_from_velocity(x, v, t), -(x - t[:, None] * mu) / var, atol=1e-4)


def test_sde_samples_match_the_ode_marginals_while_paths_differ():
    means, std, K, n = eight_gaussian_means(), 0.15, 100, 3000
    step = lambda x, t: mixture_velocity(x, t, means, std)
    x0 = torch.randn(n, 2, generator=torch.Generator().manual_seed(0))
    ode, _ = flow_sde.sample_chain(step, x0, K, "flow_sde")
    ode2, _ = flow_sde.sample_chain(step, torch.randn(n, 2, generator=torch.Generator().manual_seed(1)), K, "flow_sde")
    baseline = sliced_wasserstein(ode[:, -1], ode2[:, -1])
    mask = flow_sde.full_mask(n, K, K)
    sde, _ = flow_sde.sample_chain(step, x0, K, "flow_sde", 1.0, mask, torch.Generator().manual_seed(2))
    assert sliced_wasserstein(sde[:, -1], ode[:, -1]) <= 1.5 * baseline + 0.02
    assert (sde[:, -1] - ode[:, -1]).norm(dim=1).mean() > 0.5  # same x_0, different endpoints


def test_study_config_rejects_unknown_methods_and_finetune_keys():
    from flowlib.infra.config import ConfigError
    from flowlib.tools import pirl

    with pytest.raises(ValueError, match="unknown methods"):
        pirl.FlowSDEConfig(methods=["flow_ddim"])
    with pytest.raises(ConfigError, match="lerning_rate"):
        pirl.FlowSDEConfig(finetune={"lerning_rate": 1e-3})
    with pytest.raises(ConfigError, match="set by the comparison itself"):
        pirl.FlowSDEConfig(finetune={"noise_method": "flow_sde"})
    cfg = pirl.FlowSDEConfig(finetune={"num_envs": 4})
    run = cfg.finetune_config("flow_sde+hybrid", 2)
    assert (run.noise_method, run.hybrid, run.seed, run.num_envs, run.run_name) == ("flow_sde", True, 2, 4,
                                                                                    "flow_sde_hybrid_s2")


def test_marginal_table_flags_a_wrong_score():
    """The check can fail: an SDE whose drift uses the wrong score (sign flipped) leaves the ODE's marginals."""
    from flowlib.tools import pirl

    means = eight_gaussian_means()
    exact = lambda x, t: mixture_velocity(x, t, means, 0.15)
    good = pirl.marginal_table(exact, 100, [1.0], 4000)[0]
    assert good["within_1.5x"]
    original = flow_sde.transition

    def wrong(method, x, v, t, dt, a=0.0, noise_std=None):  # v - 2 * (v - sigma^2/2 ...): score correction reversed
        mean, std = original(method, x, v, t, dt, a, noise_std)
        return 2 * (x + v * dt) - mean, std

    flow_sde.transition = wrong
    try:
        bad = pirl.marginal_table(exact, 100, [1.0], 4000)[0]
    finally:
        flow_sde.transition = original
    assert not bad["within_1.5x"] and bad["ratio"] > 3


@pytest.mark.parametrize("n, rho", [(8, 0.9), (3, 0.5), (16, 0.0)])
def test_correlated_log_prob_equals_a_multivariate_normal_along_the_chunk(n, rho):
    torch.manual_seed(0)
    mean, x = torch.randn(5, n, 4), torch.randn(5, n, 4)
    std = 0.05 + torch.rand(5, n, 4)  # may differ per step of the chunk
    corr = (1 - rho) * torch.eye(n) + rho * torch.ones(n, n)
    expected = torch.zeros(5, dtype=torch.float64)
    for a in range(4):
        s = std[:, :, a].double()
        cov = s[:, :, None] * corr.double() * s[:, None, :]
        expected += torch.distributions.MultivariateNormal(mean[:, :, a].double(), cov).log_prob(x[:, :, a].double())
    assert torch.allclose(distributions.gaussian_log_prob(x, mean, std, rho).double(), expected, rtol=1e-5, atol=1e-4)



def test_gaussian_entropy_is_the_per_dim_mean_of_torchs_normal_entropy():
    std = 0.05 + torch.rand(6, 16, 4)
    expected = torch.distributions.Normal(torch.zeros_like(std), std).entropy().flatten(1).mean(1)  # [6]
    assert torch.allclose(distributions.gaussian_entropy(std), expected, atol=1e-6)

def test_correlated_noise_has_the_asked_correlation_and_a_bad_one_is_rejected():
    eps = flow_sde.correlated_noise((20_000, 8, 4), 0.9, torch.Generator().manual_seed(0))
    c = torch.corrcoef(eps[:, :, 0].T)  # [8, 8] over the chunk's steps
    off = c[~torch.eye(8, dtype=torch.bool)]
    assert (off - 0.9).abs().max() < 0.02 and (c.diagonal() - 1).abs().max() < 1e-5
    assert abs(torch.corrcoef(eps[:, 0, :].T)[0, 1]) < 0.03  # action dims stay independent
    with pytest.raises(ValueError, match="corr must be in"):
        distributions.gaussian_log_prob(eps[:2], eps[:2], torch.ones(1), 1.0)
