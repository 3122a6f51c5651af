"""FQL: with the Q term off the one-step policy learns the flow's own chunks for the same noise; the demos become
chunk decisions with the sparse reward's returns, terminations and bootstraps; the registry's checks."""
import numpy as np
import pytest
import torch
from test_reinflow import ACT_DIM, OBS_DIM, tiny_policy

from flowlib.envs.data import Episode
from flowlib.methods import stage3
from flowlib.methods.fql import FQLAgent, FQLSettings, demo_decisions, fql_update, train_offline


def fql_for():
    policy, dataset = tiny_policy()
    agent = FQLAgent(policy, 4, hidden_dims=(256, 256), value_hidden_dims=(16,), act_horizon=4)
    return agent, torch.stack([dataset[i][0] for i in range(32)])


@pytest.mark.slow
def test_with_the_q_term_off_the_one_step_policy_learns_the_flows_chunk_for_the_same_noise():
    agent, obs = fql_for()
    for net in agent.q.nets:  # Q == 0 everywhere: dQ/da = 0, only the distillation pulls
        torch.nn.init.zeros_(net[-1].weight), torch.nn.init.zeros_(net[-1].bias)
    o = agent.norm_obs(obs)
    z = torch.randn(len(o), agent.pred_horizon, agent.action_dim, generator=torch.Generator().manual_seed(0))
    gap = lambda: (agent.chunk(o, z) - agent.flow_chunk(o, z)).pow(2).mean().item()
    before = gap()
    cfg = stage3.Stage3Config(steer="one_step", learner="fql", reward="sparse", fql_alpha=1.0)
    actor_opt = torch.optim.Adam(agent.policy_parameters(), 3e-3)
    critic_opt = torch.optim.SGD(agent.value_parameters(), 0.0)
    batch = {"obs": obs, "latent": torch.zeros(len(obs), 4, ACT_DIM), "reward": torch.zeros(len(obs)),
             "bootstrap": torch.zeros(len(obs)), "next_obs": obs}
    for _ in range(400):
        stats = fql_update(agent, batch, actor_opt, critic_opt, cfg)
    assert stats["q_pi"] == 0.0
    with torch.no_grad():
        after = gap()
    assert after < 0.2 * before, (before, after)  # measured: 1.155 -> 0.127 in 400 steps


def test_demos_become_chunk_decisions_with_the_sparse_rewards_returns():
    agent, _ = fql_for()
    T = 11
    success = np.zeros(T, dtype=bool)
    success[9:] = True                                      # first success after step 9: the episode has 10 steps
    f = np.zeros(T, dtype=bool)
    ep = Episode(np.random.default_rng(0).normal(size=(T + 1, OBS_DIM)).astype(np.float32),
                 np.random.default_rng(1).uniform(-1, 1, size=(T, ACT_DIM)).astype(np.float32), np.zeros(T, np.float32),
                 success, f, f.copy())
    fail = Episode(ep.obs[:6], ep.actions[:5], np.zeros(5, np.float32), np.zeros(5, bool), f[:5], f[:5])
    rows = demo_decisions(agent, [ep, fail], gamma=0.9)
    # success: decisions at t = 0, 4, 8; the last runs 2 steps and ends in the success. failure: t = 0 (4), t = 4 (1)
    assert torch.allclose(rows["reward"], torch.tensor([0.0, 0.0, 0.9, 0.0, 0.0]))
    assert torch.allclose(rows["bootstrap"], torch.tensor([0.9 ** 4, 0.9 ** 4, 0.0, 0.9 ** 4, 0.9]))
    assert rows["latent"].shape == (5, 4, ACT_DIM) and rows["obs"].shape == rows["next_obs"].shape == (5, 2, OBS_DIM)
    raw = agent.action_normalizer.unnormalize(rows["latent"][1])
    assert torch.allclose(raw, torch.as_tensor(ep.actions[4:8]), atol=1e-5)  # t = 4: a_4..a_7
    assert torch.allclose(rows["obs"][1][-1], torch.as_tensor(ep.obs[4]))     # the window ends at o_4
    assert torch.allclose(rows["next_obs"][1][-1], torch.as_tensor(ep.obs[8]))


def test_evaluation_draws_z_as_given_and_the_registry_wants_the_sparse_reward():
    agent, obs = fql_for()
    z = torch.randn(len(obs), agent.pred_horizon, agent.action_dim)
    assert torch.equal(agent.act(obs, x0=z), agent.act(obs, x0=z))
    assert not torch.equal(agent.act(obs, x0=z), agent.act(obs, x0=-z))
    with pytest.raises(ValueError, match="set reward: sparse"):
        stage3.Stage3Config(steer="one_step", learner="fql", reward="dense")
    with pytest.raises(ValueError, match="does not read fql_alpha"):
        stage3.Stage3Config(fql_alpha=3.0)


@pytest.mark.slow
def test_offline_training_on_fixed_decisions_fits_the_critic_and_marks_the_agent():
    """``train_offline`` (notebook 02's FQL row, stage 3's offline phase): on fixed decisions the twin Q's TD error
    falls, the one-step policy stays near the flow (alpha large), and the agent is marked so stage 3 skips it."""
    agent, obs = fql_for()
    g = torch.Generator().manual_seed(1)
    decisions = {"obs": obs, "latent": torch.randn(len(obs), 4, ACT_DIM, generator=g).clamp(-1, 1),
                 "reward": (torch.rand(len(obs), generator=g) < 0.3).float(), "bootstrap": torch.zeros(len(obs)),
                 "next_obs": obs}

    def td_error():  # bootstrap 0: the target is the reward
        with torch.no_grad():
            q = agent.q(agent.norm_obs(obs).flatten(1), decisions["latent"].flatten(1))
        return (q - decisions["reward"]).pow(2).mean().item()

    before = td_error()
    settings = FQLSettings(fql_alpha=100.0, actor_lr=1e-3, critic_lr=3e-3, target_tau=0.005)
    stats = train_offline(agent, decisions, 300, 32, settings, seed=0)
    assert bool(agent.offline_done) and np.isfinite(stats["policy_loss"])
    after = td_error()
    assert after < 0.3 * before, (before, after)  # measured: 0.77 -> 7e-5
    assert stats["distill"] < 0.5  # measured 0.095; alpha 100 keeps mu_omega near the flow's chunks
