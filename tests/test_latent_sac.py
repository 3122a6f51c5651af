"""DSRL-SAC over x_0 (flowlib.methods.latent_sac): the replay ring, the SMDP target of the twin critics, the actor moving
toward the latents that paid with the flow untouched, the closed-form KL to N(0, I), the temperature following its
KL target, and a real PickCube run that resumes with its replay buffer."""
import math

import pytest
import torch
from test_reinflow import ACT_DIM, OBS_DIM, tiny_policy

from flowlib.envs.maniskill import make_env
from flowlib.infra.tracking import Tracker
from flowlib.methods import stage3
from flowlib.methods.latent_sac import LatentSACAgent, optimizers, prior_kl, sac_update
from flowlib.policies import bc
from flowlib.rl.buffers import ReplayBuffer

SAC = {"steer": "latent", "learner": "sac", "max_noise_std": 1.0, "final_noise_std": 1.0, "min_noise_std": 0.05,
       "latent_hidden_dims": [16], "value_hidden_dims": [32, 32]}


def sac_agent(init_alpha=0.01):
    policy, dataset = tiny_policy()
    agent = LatentSACAgent(policy, 4, min_noise_std=0.05, max_noise_std=1.0, value_hidden_dims=(32, 32),
                           latent_bound=2.5, latent_hidden=(16,), init_alpha=init_alpha)
    obs = torch.stack([dataset[i][0] for i in range(5)])
    return agent, obs


def batch_of(obs, latent, reward, bootstrap):
    return {"obs": obs, "latent": latent, "reward": reward, "bootstrap": bootstrap, "next_obs": obs.flip(0)}


def test_the_replay_is_a_ring_that_drops_the_oldest_and_saves_what_it_holds():
    buf = ReplayBuffer(5, (2, 3), (4, 2))

    def rows(start, n):
        v = torch.arange(start, start + n, dtype=torch.float32)
        return dict(obs=v[:, None, None].expand(n, 2, 3), latent=v[:, None, None].expand(n, 4, 2), reward=v,
                    bootstrap=v, next_obs=v[:, None, None].expand(n, 2, 3))

    buf.add(**rows(0, 3))
    buf.add(**rows(3, 4))  # 7 rows into 5 slots: rows 0 and 1 are gone
    assert len(buf) == 5 and sorted(buf.data["reward"].tolist()) == [2, 3, 4, 5, 6]
    sample = buf.sample(64, torch.Generator().manual_seed(0))
    assert set(sample["reward"].tolist()) <= {2, 3, 4, 5, 6} and torch.equal(sample["latent"][:, 0, 0], sample["reward"])
    again = ReplayBuffer(5, (2, 3), (4, 2))
    again.load_state_dict(buf.state_dict())
    assert again.ptr == buf.ptr and all(torch.equal(again.data[k], buf.data[k]) for k in buf.fields)
    with pytest.raises(ValueError, match="does not fit"):
        ReplayBuffer(6, (2, 3), (4, 2)).load_state_dict(buf.state_dict())
    with pytest.raises(ValueError, match="exactly the fields"):
        buf.add(obs=torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(5, (2, 3), (4, 2)).sample(2)


@pytest.mark.slow
def test_the_critics_fit_the_smdp_target_and_bootstrap_only_where_told():
    agent, obs = sac_agent()
    cfg = stage3.Stage3Config(**SAC, critic_lr=3e-3, target_tau=1.0)
    actor_opt, critic_opt = optimizers(agent, cfg)
    latent = torch.randn(5, 16, ACT_DIM, generator=torch.Generator().manual_seed(0))
    reward = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0])
    terminal = batch_of(obs, latent, reward, torch.zeros(5))  # y = R exactly
    first = sac_update(agent, terminal, actor_opt, critic_opt, cfg, train_policy=False)
    assert first["target"] == pytest.approx(reward.mean().item())
    for _ in range(300):
        last = sac_update(agent, terminal, actor_opt, critic_opt, cfg, train_policy=False)
    assert last["value_loss"] < 0.01 * first["value_loss"]
    with torch.no_grad():
        q = agent.q(agent.norm_obs(obs).flatten(1), latent.flatten(1))
    assert torch.allclose(q, reward.expand(2, 5), atol=0.05)
    # with a bootstrap factor the target adds it times min_j Q_bar_j(o', w'), w' drawn from the policy at o'
    torch.manual_seed(3)
    with torch.no_grad():
        o_next = agent.norm_obs(obs.flip(0))
        w_next, *_ = agent.rsample(o_next, torch.randn_like(latent))
        expected = reward + 0.9 * agent.q_target(o_next.flatten(1), w_next).min(0).values
    torch.manual_seed(3)
    out = sac_update(agent, batch_of(obs, latent, reward, torch.full((5,), 0.9)), actor_opt, critic_opt, cfg, False)
    assert out["target"] == pytest.approx(expected.mean().item(), abs=1e-5)
    assert "policy_loss" not in out  # the critic warm-up leaves the actor alone


@pytest.mark.slow
def test_the_actor_moves_x0_toward_the_latents_that_paid_and_leaves_the_flow_as_it_was():
    agent, obs = sac_agent()
    flow = {k: v.clone() for k, v in agent.flow.net.state_dict().items()}
    cfg = stage3.Stage3Config(**SAC, actor_lr=3e-3, critic_lr=3e-3)
    actor_opt, critic_opt = optimizers(agent, cfg)
    gen = torch.Generator().manual_seed(0)
    o = agent.norm_obs(obs)
    mu_before = agent._latent(o)[0][:, 0, 0].clone()
    for _ in range(600):  # one-decision episodes paying 1 when the first dim of x_0 is positive
        latent = torch.randn(5, 16, ACT_DIM, generator=gen)
        reward = (latent[:, 0, 0] > 0).float()
        sac_update(agent, batch_of(obs, latent, reward, torch.zeros(5)), actor_opt, critic_opt, cfg)
    mu_after = agent._latent(o)[0]
    assert (mu_after[:, 0, 0] > mu_before + 0.5).all()
    assert mu_after[:, 0, 0].mean() > 3 * mu_after[:, 1:].abs().mean()  # the other dims paid nothing
    assert all(torch.equal(flow[k], v) for k, v in agent.flow.net.state_dict().items())


def test_the_prior_kl_is_the_closed_form_gaussian_kl_per_dim():
    mu, sigma = torch.randn(3, 16, ACT_DIM), torch.rand(3, 16, ACT_DIM) + 0.1
    expected = torch.distributions.kl_divergence(torch.distributions.Normal(mu, sigma),
                                                 torch.distributions.Normal(0.0, 1.0)).flatten(1).mean(1)
    assert torch.allclose(prior_kl(mu, sigma), expected, atol=1e-6)
    assert torch.equal(prior_kl(torch.zeros(2, 4), torch.ones(2, 4)), torch.zeros(2))  # the stage-1 policy itself


@pytest.mark.parametrize("target_kl, direction", [(1e-4, 1), (1.0, -1)])
def test_alpha_rises_while_the_policy_is_further_from_the_prior_than_its_target_and_falls_while_closer(target_kl, direction):
    agent, obs = sac_agent(init_alpha=0.1)
    with torch.no_grad():
        agent.head.net[-1].bias.fill_(0.12)  # mu = 2.5 tanh(0.12) ~ 0.3: KL per dim ~ 0.045 + 0.0013 (sigma ~ 0.95)
    cfg = stage3.Stage3Config(**SAC, sac_target_kl=target_kl, sac_alpha_lr=1e-2, actor_lr=1e-6)
    actor_opt, critic_opt = optimizers(agent, cfg)
    latent = torch.randn(5, 16, ACT_DIM)
    for _ in range(20):
        out = sac_update(agent, batch_of(obs, latent, torch.zeros(5), torch.zeros(5)), actor_opt, critic_opt, cfg)
    assert 0.02 < out["kl"] < 0.1
    assert math.copysign(1, agent.log_alpha.exp().item() - 0.1) == direction


def test_the_config_refuses_sac_without_a_latent_policy_and_bad_sac_values():
    with pytest.raises(ValueError, match="steer 'chain' with learner 'sac' is not a stage-3 method"):
        stage3.Stage3Config(learner="sac")
    with pytest.raises(ValueError, match="steer 'latent' with learner 'ddpg' is not a stage-3 method"):
        stage3.Stage3Config(steer="latent", learner="ddpg")
    with pytest.raises(ValueError, match="must hold at least one batch"):
        stage3.Stage3Config(**SAC, replay_size=10, replay_batch_size=64)
    with pytest.raises(ValueError, match="target_tau"):
        stage3.Stage3Config(**SAC, target_tau=0.0)


@pytest.mark.sim
def test_sac_runs_in_a_real_pickcube_env_and_resumes_with_its_replay(tmp_path):
    policy, _ = tiny_policy()
    path = tmp_path / "stage1.pt"
    bc.save_checkpoint(path, policy, None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    per_iter = 3 * 2 * 8  # 2 envs x 3 decisions x 8 actions
    cfg = stage3.Stage3Config(init_checkpoint=str(path), num_inference_steps=4, rollout_steps=3, max_episode_steps=20,
                                  total_env_steps=2 * per_iter, critic_warmup_steps=per_iter, replay_batch_size=4,
                                  replay_updates_per_decision=0.5, eval_every=1, num_eval_episodes=2, **SAC)
    run = tmp_path / "run"
    with make_env("PickCube-v1", 2, max_episode_steps=20) as env:
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
        assert isinstance(agent, LatentSACAgent)
        before = [p.clone() for p in agent.policy_parameters()]
        tracker = Tracker(run)
        out = stage3.train(cfg, agent, env, run, tracker)
        rows = tracker.rows
        assert out["env_steps"] == 2 * per_iter and [r["critic_warmup"] for r in rows] == [1.0, 0.0]
        assert [r["updates"] for r in rows] == [3, 3] and [r["buffer"] for r in rows] == [6, 12]
        assert "policy_loss" not in rows[0] and {"policy_loss", "value_loss", "q", "alpha", "noise_std",
                                                 "eval/success_once"} <= set(rows[0]) | set(rows[1])
        assert any(not torch.equal(a, b.cpu()) for a, b in zip(before, agent.policy_parameters()))  # on a GPU, moved
        ckpt = stage3.read_agent_checkpoint(run / "last.pt")
        assert ckpt["replay"]["size"] == 12
        # a longer budget under the same name goes on from last.pt, with the 12 decisions it had
        longer = stage3.checkpoint_config(ckpt, {"total_env_steps": 3 * per_iter})
        agent2, _ = stage3.build_agent(longer, stage3.init_checkpoint_path(longer), env.spec)
        out2 = stage3.train(longer, agent2, env, run, Tracker(run))
        assert out2["env_steps"] == 3 * per_iter
        assert stage3.read_agent_checkpoint(run / "last.pt")["replay"]["size"] == 18
        # a PPO run cannot resume from it
        ppo = stage3.checkpoint_config(ckpt, {"learner": "ppo", "total_env_steps": 4 * per_iter})
        with pytest.raises(ValueError, match="use another run_name"):
            stage3.train(ppo, stage3.build_agent(ppo, path, env.spec)[0], env, run)
    # stage 3's loader and the deterministic policy: x_0 = mu(o), the same after a reload
    reloaded = stage3.load_agent(run / "last.pt")
    assert isinstance(reloaded, LatentSACAgent)
    window = torch.randn(3, 2, OBS_DIM)
    assert torch.equal(reloaded.act(window), agent2.eval().cpu().act(window))  # trained on the GPU if any
