"""The Gaussian baseline (steer "gaussian"): its log-prob against torch's Normal over the executed dims, the ratio is
1 before an update, deterministic actions are the mean, and the registry takes it with PPO only."""
import pytest
import torch
from test_reinflow import tiny_policy

from flowlib.methods import stage3
from flowlib.methods.gaussian import GaussianChunkAgent, soft_clip
from flowlib.rl import ppo


def gaussian_for(**kw):
    policy, dataset = tiny_policy()
    agent = GaussianChunkAgent(policy, 0.05, 0.3, value_hidden_dims=(16,), hidden_dims=(32,), act_horizon=4, **kw)
    return agent, torch.stack([dataset[i][0] for i in range(6)])


@pytest.mark.parametrize("reduce", ["sum", "mean_dim"])
def test_log_prob_is_the_normal_density_of_the_executed_dims(reduce):
    agent, obs = gaussian_for(log_prob_reduce=reduce)
    chain, log_prob = agent.sample(obs, torch.Generator().manual_seed(0))
    assert chain.shape == (6, 2, agent.pred_horizon, agent.action_dim) and torch.equal(chain[:, 0], 0 * chain[:, 0])
    with torch.no_grad():
        mu = agent.mean(agent._norm_obs(obs))
    s = slice(agent.obs_horizon - 1, agent.obs_horizon - 1 + agent.act_horizon)
    std = agent.std().expand_as(mu)
    expected = torch.distributions.Normal(mu[:, s].double(), std[:, s].double()).log_prob(chain[:, 1, s].double())
    expected = expected.flatten(1).sum(1) / (agent.act_horizon * agent.action_dim if reduce == "mean_dim" else 1)
    assert torch.allclose(log_prob.double(), expected, atol=1e-4)
    with torch.no_grad():
        assert torch.allclose(agent.log_prob(obs, chain)[0], log_prob, atol=1e-5)  # PPO's ratio starts at 1
    # a draw differing only in the chunk's unexecuted dims has the same log-prob
    moved = chain.clone()
    moved[:, 1, -1] += 1.0
    with torch.no_grad():
        assert torch.allclose(agent.log_prob(obs, moved)[0], log_prob, atol=1e-5)


def test_deterministic_actions_are_the_mean_and_a_ppo_update_runs():
    agent, obs = gaussian_for()
    with torch.no_grad():
        mu = agent.mean(agent._norm_obs(obs))
    s = slice(agent.obs_horizon - 1, agent.obs_horizon - 1 + agent.act_horizon)
    assert torch.allclose(agent.act(obs), agent.action_normalizer.unnormalize(mu[:, s]).clamp(-1, 1))
    chain, log_prob, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(1), return_steps=True)
    batch = {"obs": obs, "chains": chain, "log_probs": log_prob, "stochastic": stochastic, "step_log_probs": step_lp,
             "values": torch.zeros(6), "advantages": torch.linspace(-1, 1, 6), "returns": torch.randn(6)}
    cfg = stage3.Stage3Config(steer="gaussian", minibatch_size=6, update_epochs=2)
    before = [p.detach().clone() for p in agent.policy_parameters()]
    stats = ppo.ppo_update(agent, batch, torch.optim.Adam(agent.policy_parameters(), 1e-2),
                           torch.optim.Adam(agent.value_parameters(), 1e-2), cfg)
    assert stats["policy_steps"] == 2 and any(not torch.equal(a, b) for a, b in zip(before, agent.policy_parameters()))


def test_the_registry_takes_the_gaussian_with_ppo_and_refuses_what_it_cannot_read():
    assert stage3.method(stage3.Stage3Config(steer="gaussian")).summary.startswith("the baseline")
    with pytest.raises(ValueError, match="not a stage-3 method"):
        stage3.Stage3Config(steer="gaussian", learner="sac")
    with pytest.raises(ValueError, match="critic_input must be 'obs'"):
        stage3.Stage3Config(steer="gaussian", critic_input="velocity_features")
    with pytest.raises(ValueError, match="does not read gaussian_bc_steps"):
        stage3.Stage3Config(steer="chain", gaussian_bc_steps=10)


def test_a_bounded_mean_never_leaves_its_bound_and_is_the_unbounded_mean_well_inside_it():
    """``gaussian_mean_bound``: mu = b tanh(mu_phi / b), so PPO cannot push the mean out of the action box (peg's drift)."""
    agent, obs = gaussian_for(mean_bound=2.0)
    free, _ = gaussian_for()
    free.load_state_dict(agent.state_dict())
    with torch.no_grad():
        for p in agent.mean_net[-1].parameters():  # a mean far outside the box, as PPO left peg-insert-side's
            p.mul_(1e3)
        free.load_state_dict(agent.state_dict())
        far_bounded, far_free = agent.mean(agent._norm_obs(obs)), free.mean(free._norm_obs(obs))
    assert far_free.abs().max() > 20 and far_bounded.abs().max() <= 2.0
    x = torch.linspace(-0.2, 0.2, 9)
    assert torch.allclose(soft_clip(x, 2.0), x, atol=2e-3) and torch.equal(soft_clip(x, 0.0), x)
    with pytest.raises(ValueError, match="gaussian_mean_bound must be >= 0"):
        gaussian_for(mean_bound=-1.0)
