"""Residual steering (flowlib.methods.residual): the residual's log-prob, the executed actions it corrects, the stage-1
policy at the start, PPO moving only the residual policy, and what is refused."""
import pytest
import torch
from test_reinflow import ACT_DIM, fake_batch, tiny_policy
from test_residual_step import load_benchmark

from flowlib.methods import stage3
from flowlib.methods.residual import ResidualAgent
from flowlib.rl import ppo

TA, START = 8, 1  # the tiny policy's act_horizon; executed rows start at obs_horizon - 1


def residual_agent(K=4, bound=0.5, **kwargs):
    policy, dataset = tiny_policy()
    agent = ResidualAgent(policy, K, min_noise_std=0.01, max_noise_std=0.2, value_hidden_dims=(16,),
                          residual_bound=bound, residual_hidden=(16,), **kwargs)
    obs = torch.stack([dataset[i][0] for i in range(5)])
    return agent, obs, policy


@pytest.mark.parametrize("per", ["action", "chunk"])
def test_log_prob_is_the_residual_gaussian_and_the_chunk_is_the_base_plus_the_residual(per):
    agent, obs, policy = residual_agent(residual_per=per)
    n = TA if per == "action" else 1  # rows of r: one per executed action, or one for the chunk
    with torch.no_grad():  # move mu and sigma away from their start so the check sees them
        agent.head.net[-1].bias.normal_(0, 1.0)
        agent.head.std_logit.normal_(0, 1.0)
    x0 = torch.randn(5, 16, ACT_DIM, generator=torch.Generator().manual_seed(3))
    chain, log_prob, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(1), return_steps=True, x0=x0)
    base = agent.action_normalizer.normalize(policy.chunk(obs, x0, 4))              # the stage-1 chunk from x_0
    r = chain[:, 0, START:START + n]                                                # [5, n, A]
    assert torch.equal(chain[:, 0, :START], torch.zeros_like(chain[:, 0, :START]))
    assert torch.equal(chain[:, 0, START + n:], torch.zeros_like(chain[:, 0, START + n:]))
    assert torch.allclose(chain[:, -1, START:START + TA], base[:, START:START + TA] + r, atol=1e-5)
    assert torch.allclose(chain[:, -1, START + TA:], base[:, START + TA:], atol=1e-5)  # what does not run is untouched
    o = agent.norm_obs(obs)
    mu = 0.5 * torch.tanh(agent.head.net(torch.cat([o.flatten(1), base[:, START:START + TA].flatten(1)], 1)))
    mu = mu.view(5, n, ACT_DIM)
    sigma = 0.01 + 0.19 * torch.sigmoid(agent.head.std_logit).view(n, ACT_DIM)
    expected = torch.distributions.Normal(mu, sigma).log_prob(r).flatten(1).sum(1)
    assert torch.allclose(log_prob, expected, atol=1e-4)
    assert stochastic.shape == step_lp.shape == (5, 1) and stochastic.all() and chain.shape == (5, 2, 16, ACT_DIM)
    # re-scoring recovers a_b = x_K - r without the flow and gives the same log-prob (PPO's ratio is 1)
    rescored, entropy = agent.log_prob(obs, chain, stochastic)
    assert torch.allclose(rescored, log_prob, atol=1e-4)
    assert torch.allclose(entropy, torch.distributions.Normal(mu, sigma).entropy().flatten(1).mean(1), atol=1e-5)
    assert mu.abs().max() <= 0.5
    det, _ = agent.sample(obs, deterministic=True, x0=x0)  # the deterministic policy adds mu
    assert torch.allclose(det[:, 0, START:START + n], mu, atol=1e-5)
    assert torch.allclose(det[:, -1, START:START + TA] - base[:, START:START + TA], mu.expand(5, TA, ACT_DIM), atol=1e-5)


def test_at_the_start_the_deterministic_policy_is_the_stage1_policy_and_the_noisy_one_adds_sigma():
    agent, obs, policy = residual_agent()
    x0 = torch.randn(5, 16, ACT_DIM, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(agent.act(obs, x0=x0), policy.act(obs, 4, x0=x0).clamp(-1, 1), atol=1e-5)
    chain, _ = agent.sample(obs, torch.Generator().manual_seed(4), x0=x0)
    r = chain[:, 0, START:START + TA]                                        # 5 x 8 x 4 draws of r ~ N(0, sigma^2)
    assert r.mean().abs() < 0.05 and 0.16 < r.std() < 0.22  # sigma ~ 0.95 max_noise_std = 0.19
    agent.explore = torch.Generator().manual_seed(4)  # collecting data: the same draw, executed
    assert torch.allclose(agent.act(obs, x0=x0), agent.actions(chain), atol=1e-6)


def test_ppo_moves_the_residual_policy_and_leaves_the_flow_as_it_was():
    agent, obs, _ = residual_agent()
    flow = {k: v.clone() for k, v in agent.flow.net.state_dict().items()}
    x0 = torch.randn(5, 16, ACT_DIM)
    base = agent.flow.executed(agent.sample(obs, deterministic=True, x0=x0)[0][:, -1])
    o = agent.norm_obs(obs)
    mu, sigma = (x.detach().clone() for x in agent._residual(o, base))
    cfg = stage3.Stage3Config(minibatch_size=5, update_epochs=2, steer="residual")
    opt_a = torch.optim.Adam(agent.policy_parameters(), 1e-3)
    opt_c = torch.optim.Adam(agent.value_parameters(), 1e-3)
    stats = ppo.ppo_update(agent, fake_batch(agent, obs), opt_a, opt_c, cfg)  # checks ratio == 1 first
    assert stats["policy_steps"] == 2
    assert all(torch.equal(flow[k], v) for k, v in agent.flow.net.state_dict().items())
    assert not torch.allclose(agent._residual(o, base)[0], mu) and not torch.allclose(agent._residual(o, base)[1], sigma)


def test_what_has_no_meaning_for_a_residual_policy_is_refused():
    with pytest.raises(ValueError, match="steer 'residual' draws one Gaussian .* hybrid must be False"):
        residual_agent(hybrid=True)
    with pytest.raises(ValueError, match="residual_bound must be > 0"):
        residual_agent(bound=0.0)
    with pytest.raises(ValueError, match="'residual_bound' = -1.0: should be greater than 0"):
        stage3.Stage3Config(steer="residual", residual_bound=-1.0)
    with pytest.raises(ValueError, match="residual_per must be one of"):
        residual_agent(residual_per="step")
    with pytest.raises(ValueError, match="residual_per must be one of"):
        stage3.Stage3Config(steer="residual", residual_per="step")
    with pytest.raises(ValueError, match="steer 'residual' cannot branch"):
        stage3.Stage3Config(steer="residual", advantage="branch", branches=2)
    with pytest.raises(ValueError, match="steer 'residual' with learner 'sac' is not a stage-3 method"):
        stage3.Stage3Config(steer="residual", learner="sac")


def test_the_residual_mean_benchmark_reads_mu_per_action_dim():
    bench = load_benchmark("residual_mean")
    agent, obs, _ = residual_agent(residual_per="chunk")
    c = torch.tensor([0.3, -2.0, 0.0, 1.0])  # mu = 0.5 tanh(c) whatever the input: a known push per dim
    with torch.no_grad():
        agent.head.net[-1].weight.zero_()
        agent.head.net[-1].bias.copy_(c)
    stats = bench.residual_stats(agent, obs, torch.Generator().manual_seed(0))
    mu = 0.5 * torch.tanh(c)
    assert stats["windows"] == 5 and stats["rows"] == 1 and stats["bound"] == 0.5
    assert torch.allclose(torch.tensor(stats["mean_mu"]), mu, atol=1e-6)
    assert torch.allclose(torch.tensor(stats["mean_abs_mu"]), mu.abs(), atol=1e-6)
    assert stats["share_near_bound"] == [0.0, 1.0, 0.0, 1.0]  # |mu| > 0.375: 0.48 (dim 1) and 0.38 (dim 3)
    with pytest.raises(ValueError, match="reads a steer 'residual' checkpoint"):
        bench.residual_stats(object(), obs, torch.Generator())


@pytest.mark.parametrize("per", ["action", "chunk"])
def test_with_the_gripper_left_to_the_base_r_has_the_arm_dims_only(per):
    agent, obs, policy = residual_agent(residual_per=per, correct_gripper=False)
    n = TA if per == "action" else 1
    with torch.no_grad():  # a correction on every dim, were it allowed
        agent.head.net[-1].bias.normal_(0, 1.0)
        agent.head.std_logit.normal_(0, 1.0)
    x0 = torch.randn(5, 16, ACT_DIM, generator=torch.Generator().manual_seed(3))
    chain, log_prob, stochastic, _ = agent.sample(obs, torch.Generator().manual_seed(1), return_steps=True, x0=x0)
    base = agent.action_normalizer.normalize(policy.chunk(obs, x0, 4))
    assert torch.equal(chain[:, 0, START:START + n, -1], torch.zeros(5, n))              # no draw on the gripper
    assert torch.allclose(chain[:, -1, :, -1], base[:, :, -1], atol=1e-5)               # its action is the base's
    r = chain[:, 0, START:START + n, :-1]                                               # [5, n, A - 1]
    assert (r.abs() > 0).all()
    assert torch.allclose(chain[:, -1, START:START + TA, :-1], base[:, START:START + TA, :-1] + r, atol=1e-5)
    o = agent.norm_obs(obs)
    mu = 0.5 * torch.tanh(agent.head.net(torch.cat([o.flatten(1), base[:, START:START + TA].flatten(1)], 1)))
    mu = mu.view(5, n, ACT_DIM - 1)
    sigma = 0.01 + 0.19 * torch.sigmoid(agent.head.std_logit).view(n, ACT_DIM - 1)
    expected = torch.distributions.Normal(mu, sigma).log_prob(r).flatten(1).sum(1)      # n x (A - 1) dims
    assert torch.allclose(log_prob, expected, atol=1e-4)
    assert torch.allclose(agent.log_prob(obs, chain, stochastic)[0], log_prob, atol=1e-4)  # PPO's ratio is 1
    cfg = stage3.Stage3Config(steer="residual", residual_per=per, residual_gripper=False)
    assert not stage3.make_agent(policy, cfg).correct_gripper                               # the config's way in
