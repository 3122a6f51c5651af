"""Steering x_0 (flowlib.methods.latent): the latent policy's log-prob, the chain it starts, the stage-1 policy at the
start, PPO moving only the latent policy, and what the config refuses."""
import pytest
import torch
from test_reinflow import ACT_DIM, fake_batch, tiny_policy

from flowlib.methods import stage3
from flowlib.methods.latent import LatentSteeringAgent
from flowlib.rl import ppo


def latent_agent(K=4, bound=2.5, **kwargs):
    policy, dataset = tiny_policy()
    agent = LatentSteeringAgent(policy, K, min_noise_std=0.05, max_noise_std=1.0, value_hidden_dims=(16,),
                                latent_bound=bound, latent_hidden=(16,), **kwargs)
    obs = torch.stack([dataset[i][0] for i in range(5)])
    return agent, obs, policy


def test_log_prob_is_the_latent_gaussian_of_x0_and_the_chain_is_the_ode_from_it():
    agent, obs, policy = latent_agent()
    with torch.no_grad():  # move mu and sigma away from their start so the check sees them
        agent.head.net[-1].bias.normal_(0, 1.0)
        agent.head.std_logit.normal_(0, 1.0)
    chain, log_prob, stochastic, step_lp = agent.sample(obs, torch.Generator().manual_seed(1), return_steps=True)
    o = agent.norm_obs(obs)
    mu = 2.5 * torch.tanh(agent.head.net(o.flatten(1))).view(5, 16, ACT_DIM)
    sigma = 0.05 + 0.95 * torch.sigmoid(agent.head.std_logit).view(16, ACT_DIM)
    expected = torch.distributions.Normal(mu, sigma).log_prob(chain[:, 0]).flatten(1).sum(1)
    assert torch.allclose(log_prob, expected, atol=1e-4)
    assert stochastic.shape == step_lp.shape == (5, 1) and stochastic.all() and chain.shape == (5, 2, 16, ACT_DIM)
    # the chain from x_0 is the frozen flow's ODE: the stage-1 policy's chunk from the same x_0
    assert torch.allclose(agent.action_normalizer.unnormalize(chain[:, -1]), policy.chunk(obs, chain[:, 0], 4), atol=1e-5)
    # re-scoring gives the same log-prob (PPO's ratio is 1 before an update), and the Gaussian's entropy
    rescored, entropy = agent.log_prob(obs, chain, stochastic)
    assert torch.allclose(rescored, log_prob, atol=1e-5)
    assert torch.allclose(entropy, torch.distributions.Normal(mu, sigma).entropy().flatten(1).mean(1), atol=1e-5)
    # the mean stays within the bound; the deterministic chain starts from it
    assert mu.abs().max() <= 2.5
    det, _ = agent.sample(obs, deterministic=True)
    assert torch.allclose(det[:, 0], mu, atol=1e-6)


def test_at_the_start_the_noisy_policy_is_the_stage1_policy_and_the_deterministic_one_starts_at_zero():
    agent, obs, policy = latent_agent()
    eps = torch.randn(5, 16, ACT_DIM, generator=torch.Generator().manual_seed(2))
    agent.explore = torch.Generator()
    sigma = agent._latent(agent.norm_obs(obs))[1]
    assert torch.allclose(agent.act(obs, x0=eps), policy.act(obs, 4, x0=sigma * eps).clamp(-1, 1), atol=1e-5)
    agent.explore = None
    assert torch.allclose(agent.act(obs, x0=eps), policy.act(obs, 4, x0=torch.zeros_like(eps)).clamp(-1, 1), atol=1e-5)


def test_ppo_moves_the_latent_policy_and_leaves_the_flow_as_it_was():
    agent, obs, _ = latent_agent()
    flow = {k: v.clone() for k, v in agent.flow.net.state_dict().items()}
    o = agent.norm_obs(obs)
    mu, sigma = (x.detach().clone() for x in agent._latent(o))
    assert {id(p) for p in agent.policy_parameters()}.isdisjoint(id(p) for p in agent.flow.parameters())
    cfg = stage3.Stage3Config(minibatch_size=5, update_epochs=2, steer="latent")
    opt_a = torch.optim.Adam(agent.policy_parameters(), 1e-3)
    opt_c = torch.optim.Adam(agent.value_parameters(), 1e-3)
    stats = ppo.ppo_update(agent, fake_batch(agent, obs), opt_a, opt_c, cfg)  # checks ratio == 1 first
    assert stats["policy_steps"] == 2
    assert all(torch.equal(flow[k], v) for k, v in agent.flow.net.state_dict().items())
    assert not torch.allclose(agent._latent(o)[0], mu) and not torch.allclose(agent._latent(o)[1], sigma)


def test_what_has_no_meaning_for_a_latent_policy_is_refused():
    with pytest.raises(ValueError, match="hybrid must be False"):
        latent_agent(hybrid=True)
    with pytest.raises(ValueError, match="include_initial_noise must be False"):
        latent_agent(include_initial_noise=True)
    with pytest.raises(ValueError, match="latent_bound must be > 0"):
        latent_agent(bound=0.0)
    with pytest.raises(ValueError, match="steer .weights. with learner .ppo. is not a stage-3 method"):
        stage3.Stage3Config(steer="weights")
    with pytest.raises(ValueError, match="cannot branch"):
        stage3.Stage3Config(steer="latent", advantage="branch", branches=2)


def _benchmark():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "latent_steering.py"
    spec = importlib.util.spec_from_file_location("latent_steering", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steering_x0_moves_the_commanded_displacement_within_the_bound():
    bench = _benchmark()
    policy, dataset = tiny_policy()
    window = torch.stack([dataset[i][0] for i in range(3)])
    u = torch.tensor([[1.0, 0.0, 0.0]]).expand(3, 3)
    start = policy.obs_horizon - 1

    def push(x0):  # u . sum of the executed actions' xyz
        return (policy.chunk(window, x0, 4)[:, start:start + policy.act_horizon, :3].sum(1) * u).sum(1)

    x0, back = (bench.steer(policy, window, v, 1.5, 4, 30, 0.1) for v in (u, -u))
    assert x0.abs().max() <= 1.5 and back.abs().max() <= 1.5
    with torch.no_grad():
        mode = push(torch.zeros_like(x0))
        assert (push(x0) > mode + 1e-3).all() and (push(back) < mode - 1e-3).all()


@pytest.mark.sim
def test_the_steering_benchmark_stops_with_a_clear_message_when_the_policy_never_grasps(tmp_path, monkeypatch):
    from flowlib.policies import bc
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    policy, _ = tiny_policy()
    path = tmp_path / "stage1.pt"
    bc.save_checkpoint(path, policy, None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    with pytest.raises(SystemExit, match="no carry state .* in 1 x 2 episodes"):
        _benchmark().main([str(path), "--num-envs", "2", "--max-batches", "1", "--max-decisions", "2"])
