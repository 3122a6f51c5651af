"""Stage 3 (ReinFlow): chain log-probs, the PPO ratio before an update, SMDP GAE, noise schedules,
critic warm-up, and a two-iteration fine-tune in a real PickCube env."""
import csv
import dataclasses
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_smdp import SolvedFromStep

from flowlib.envs import smdp
from flowlib.envs.data import ChunkDataset, Episode
from flowlib.envs.maniskill import make_env
from flowlib.infra.config import ConfigError
from flowlib.infra.tracking import Tracker
from flowlib.methods import reinflow, reinflow_agent, stage3
from flowlib.policies import bc
from flowlib.rl import advantages, loop, ppo
from flowlib.tools import evaluate

OBS_DIM, ACT_DIM = 42, 4  # PickCube-v1, state obs, pd_ee_delta_pos
REPO = Path(__file__).resolve().parents[1]


def tiny_policy(seed=0, obs_emb_dim=0):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    eps = []
    for _ in range(3):
        T = 20
        f = np.zeros(T, dtype=bool)
        eps.append(Episode(rng.normal(size=(T + 1, OBS_DIM)).astype(np.float32),
                           rng.uniform(-1, 1, size=(T, ACT_DIM)).astype(np.float32), np.zeros(T, np.float32),
                           f, f.copy(), f.copy()))
    dataset = ChunkDataset(eps, 2, 16)
    cfg = bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8, obs_emb_dim=obs_emb_dim)
    return bc.build_policy(bc.policy_meta(cfg, dataset, "pd_ee_delta_pos"), dataset.obs_normalizer,
                           dataset.action_normalizer), dataset


def tiny_agent(K=4, include_initial_noise=False, log_prob_over="chunk", act_horizon=None, log_prob_reduce="sum"):
    policy, dataset = tiny_policy()
    agent = reinflow_agent.ReinFlowAgent(policy, K, min_noise_std=0.05, max_noise_std=0.3, value_hidden_dims=(16,),
                                         include_initial_noise=include_initial_noise, noise_hidden=16,
                                         log_prob_over=log_prob_over, act_horizon=act_horizon,
                                         log_prob_reduce=log_prob_reduce)
    obs = torch.stack([dataset[i][0] for i in range(5)])  # normalised windows; any raw values will do
    return agent, obs


@pytest.mark.parametrize("include_initial_noise, log_prob_over, act_horizon",
                         [(False, "chunk", None), (True, "chunk", None), (True, "executed", None), (False, "executed", 3),
                          (True, "executed_last", None), (False, "executed_last", 3)])
def test_chain_log_prob_equals_a_closed_form_gaussian_computation(include_initial_noise, log_prob_over, act_horizon):
    agent, obs = tiny_agent(K=4, include_initial_noise=include_initial_noise, log_prob_over=log_prob_over,
                            act_horizon=act_horizon)
    Ta = act_horizon or 8  # the policy's own is 8
    executed, every = slice(1, 1 + Ta), slice(None)  # To - 1 = 1
    chain, log_prob = agent.sample(obs, torch.Generator().manual_seed(1))
    assert chain.shape == (5, 5, 16, ACT_DIM) and log_prob.shape == (5,)
    assert agent.actions(chain).shape == (5, Ta, ACT_DIM)
    # independent computation: step by step with torch.distributions, on linspace(0, 1, K + 1)
    o = agent.obs_normalizer.normalize(obs)
    expected = torch.zeros(5, dtype=torch.float64)
    if include_initial_noise:
        dims = executed if log_prob_over == "executed" else every
        expected += torch.distributions.Normal(0.0, 1.0).log_prob(chain[:, 0, dims].double()).flatten(1).sum(1)
    with torch.no_grad():
        for k, t in enumerate(np.linspace(0, 1, 5)[:-1]):
            tt = torch.full((5,), float(t))
            v = agent.actor.base(chain[:, k], tt, torch.full((5,), 0.25), o)
            std = agent.actor.noise_net(tt, o.flatten(1))[:, None, :].expand_as(v)
            mean = chain[:, k] + 0.25 * v
            last = k == 3  # executed_last scores only the executed actions of x_K
            dims = executed if log_prob_over == "executed" or (log_prob_over == "executed_last" and last) else every
            normal = torch.distributions.Normal(mean[:, dims].double(), std[:, dims].double())
            expected += normal.log_prob(chain[:, k + 1, dims].double()).flatten(1).sum(1)
    assert torch.allclose(log_prob.double(), expected, rtol=1e-4, atol=1e-2)
    with torch.no_grad():
        rescored, entropy = agent.log_prob(obs, chain)
    assert torch.allclose(rescored, log_prob, rtol=1e-5, atol=1e-3)
    assert entropy.shape == (5,) and torch.isfinite(entropy).all()


@pytest.mark.parametrize("log_prob_over, include_initial_noise, dims",
                         # K = 4, H = 16, Ta = 8, A = 4: 64 dims per step, 32 executed
                         [("chunk", False, 4 * 64), ("chunk", True, 5 * 64), ("executed", True, 5 * 32),
                          ("executed_last", False, 3 * 64 + 32), ("executed_last", True, 4 * 64 + 32)])
def test_mean_dim_divides_the_joint_log_prob_by_the_dims_it_scores(log_prob_over, include_initial_noise, dims):
    summed, obs = tiny_agent(include_initial_noise=include_initial_noise, log_prob_over=log_prob_over)
    per_dim, _ = tiny_agent(include_initial_noise=include_initial_noise, log_prob_over=log_prob_over,
                            log_prob_reduce="mean_dim")
    chain, log_prob = summed.sample(obs, torch.Generator().manual_seed(3))
    with torch.no_grad():
        rescored, _ = per_dim.log_prob(obs, chain)
        _, sampled = per_dim.sample(obs, torch.Generator().manual_seed(3))
    assert torch.allclose(rescored, log_prob / dims, rtol=1e-5, atol=1e-6)
    assert torch.allclose(sampled, rescored, rtol=1e-5, atol=1e-6)  # sampling and re-scoring agree
    hybrid = torch.zeros(5, 4, dtype=torch.bool)
    hybrid[:, 3] = True  # only the last step stochastic: its dims alone, plus x_0's
    step_lp, _ = per_dim.step_log_probs(obs, chain, hybrid)
    last = 32 if log_prob_over != "chunk" else 64
    x0 = (32 if log_prob_over == "executed" else 64) if include_initial_noise else 0
    expected = step_lp[:, 3].clone()
    if include_initial_noise:
        expected += torch.distributions.Normal(0.0, 1.0).log_prob(per_dim.score.scored_x0(chain[:, 0])).flatten(1).sum(1)
    assert torch.allclose(per_dim.joint_log_prob(step_lp, hybrid, chain), expected / (last + x0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("log_prob_over", ["chunk", "executed_last"])
def test_chunk_correlated_noise_is_drawn_and_scored_as_one_multivariate_normal(log_prob_over):
    policy, dataset = tiny_policy()
    rho = 0.8
    agent = reinflow_agent.ReinFlowAgent(policy, 2, min_noise_std=0.05, max_noise_std=0.3, value_hidden_dims=(16,),
                                         noise_hidden=16, log_prob_over=log_prob_over, noise_corr=rho)
    obs = torch.stack([dataset[i][0] for i in range(5)])
    chain, log_prob = agent.sample(obs, torch.Generator().manual_seed(2))
    o = agent.obs_normalizer.normalize(obs)
    expected = torch.zeros(5, dtype=torch.float64)
    with torch.no_grad():
        for k, t in enumerate((0.0, 0.5)):
            tt = torch.full((5,), t)
            v = agent.actor.base(chain[:, k], tt, torch.full((5,), 0.5), o)
            std = agent.actor.noise_net(tt, o.flatten(1))                            # [5, A], shared over H
            mean = chain[:, k] + 0.5 * v
            rows = slice(1, 9) if (log_prob_over == "executed_last" and k == 1) else slice(None)
            n = len(range(16)[rows])
            corr = ((1 - rho) * torch.eye(n) + rho * torch.ones(n, n)).double()
            for a in range(ACT_DIM):
                cov = std[:, a, None, None].double() ** 2 * corr
                mvn = torch.distributions.MultivariateNormal(mean[:, rows, a].double(), cov)
                expected += mvn.log_prob(chain[:, k + 1, rows, a].double())
        rescored, _ = agent.log_prob(obs, chain)
    assert torch.allclose(log_prob.double(), expected, rtol=1e-4, atol=1e-2)
    assert torch.allclose(rescored, log_prob, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="noise_corr must be in"):
        stage3.Stage3Config(noise_corr=1.0)


def test_noise_std_stays_in_its_bounds_and_follows_the_max():
    agent, obs = tiny_agent()
    o = agent.obs_normalizer.normalize(obs).flatten(1)
    for max_std in (0.3, 0.1, 0.05):
        agent.set_max_noise_std(max_std)
        std = agent.actor.noise_net(torch.rand(5), o)
        assert std.shape == (5, ACT_DIM) and (std >= 0.05 - 1e-7).all() and (std <= max_std + 1e-7).all()


def test_reinflows_guards_keep_means_in_the_action_range_and_draws_within_3_sigma_and_score_alike():
    """clip_chain_means and noise_clip (ReinFlow's denoised and randn clips): every stochastic step's mean lies in
    the normalised action range, every step's draw within 3 sigma of it, and re-scoring the stored chains gives the
    log-probs the sampler recorded (the ratio starts at 1 with the guards on)."""
    policy, dataset = tiny_policy()
    agent = reinflow_agent.ReinFlowAgent(policy, 4, min_noise_std=0.2, max_noise_std=0.3, value_hidden_dims=(16,),
                                         noise_hidden=16, clip_chain_means=True, noise_clip=3.0)
    obs = torch.stack([dataset[i][0] for i in range(5)]).repeat(40, 1, 1)                   # [200, To, O]
    chain, log_prob, stochastic, _ = agent.sample(obs, torch.Generator().manual_seed(0), return_steps=True)
    low, high = agent.mean_bounds()
    assert torch.allclose(agent.action_normalizer.unnormalize(low), -torch.ones(ACT_DIM))
    o = agent.obs_normalizer.normalize(obs)
    with torch.no_grad():
        for k in range(4):
            t = torch.full((len(obs),), k / 4)
            mean = chain[:, k] + 0.25 * agent.actor.base(chain[:, k], t, torch.full_like(t, 0.25), o)
            clamped = torch.maximum(torch.minimum(mean, high), low)
            std = agent.actor.noise_net(t, o.flatten(1))[:, None]
            assert ((chain[:, k + 1] - clamped).abs() <= 3 * std + 1e-5).all()
            assert (mean != clamped).any() or k > 0  # the clamp binds somewhere, or the test proves nothing
    rescored, _ = agent.log_prob(obs, chain, stochastic)
    assert torch.allclose(rescored, log_prob, atol=1e-4)
    with pytest.raises(ValueError, match="noise_clip"):
        reinflow_agent.ReinFlowAgent(policy, 4, noise_clip=-1.0)


@pytest.mark.parametrize("kind, expected", [("constant", (1.0, 1.0, 1.0)), ("cosine", (1.0, 0.55, 0.1))])
def test_learning_rate_schedules_at_start_half_and_end(kind, expected):
    assert [loop.lr_factor(kind, p, 0.1) for p in (0.0, 0.5, 1.0)] == pytest.approx(expected)
    with pytest.raises(ValueError, match="lr_schedule"):
        loop.lr_factor("step", 0.5, 0.1)


def test_deterministic_chain_is_the_ode_of_the_flow():
    agent, obs = tiny_agent(K=4)
    chain, _ = agent.sample(obs, torch.Generator().manual_seed(0), deterministic=True)
    noise = chain[:, 0]
    ode = agent.actor.base  # the flow's own Euler sampler, same grid and jump
    x = noise
    with torch.no_grad():
        for k in range(4):
            x = x + 0.25 * ode(x, torch.full((5,), k / 4), torch.full((5,), 0.25), agent.obs_normalizer.normalize(obs))
    assert torch.allclose(chain[:, -1], x, atol=1e-6)
    assert agent.act(obs).shape == (5, 8, ACT_DIM) and agent.act(obs).abs().max() <= 1


def test_act_runs_the_noisy_chain_while_explore_is_set():
    """evaluate --noisy: with a generator in ``explore``, act() is the training-time (noisy) chain, drawn from
    that generator; without, the deterministic chain again."""
    agent, obs = tiny_agent(K=4)
    x0 = torch.randn(5, agent.pred_horizon, ACT_DIM, generator=torch.Generator().manual_seed(1))
    deterministic = agent.act(obs, x0=x0)
    agent.explore = torch.Generator().manual_seed(0)
    noisy = agent.act(obs, x0=x0)
    chain, _ = agent.sample(obs, torch.Generator().manual_seed(0), x0=x0)
    assert torch.equal(noisy, agent.actions(chain)) and not torch.allclose(noisy, deterministic)
    agent.explore = None
    assert torch.equal(agent.act(obs, x0=x0), deterministic)


def test_rescoring_on_another_time_grid_is_caught_by_the_ratio_check(monkeypatch):
    agent, obs = tiny_agent()
    cfg = stage3.Stage3Config(minibatch_size=4, update_epochs=1)
    batch = fake_batch(agent, obs)
    opt_a = torch.optim.Adam(agent.policy_parameters(), 1e-4)
    opt_c = torch.optim.Adam(agent.value_parameters(), 1e-4)
    ppo.ppo_update(agent, batch, opt_a, opt_c, cfg)  # same grid: ratio == 1, no error
    batch = fake_batch(agent, obs)
    shifted = lambda K, device=None: torch.linspace(0, 1 - 1 / K, K + 1, device=device)  # the public bug
    monkeypatch.setattr(reinflow_agent, "time_grid", shifted)
    with pytest.raises(RuntimeError, match="ratio .* before any update"):
        ppo.ppo_update(agent, batch, opt_a, opt_c, cfg)


def fake_batch(agent, obs):
    chain, log_prob, stochastic, step_log_probs = agent.sample(obs, torch.Generator().manual_seed(3), return_steps=True)
    n = len(obs)
    return {"obs": obs, "chains": chain, "log_probs": log_prob, "stochastic": stochastic,
            "step_log_probs": step_log_probs, "values": torch.zeros(n), "advantages": torch.randn(n),
            "returns": torch.randn(n)}


def test_critic_warmup_leaves_the_policy_unchanged_and_trains_the_value():
    agent, obs = tiny_agent()
    before = {k: v.clone() for k, v in agent.actor.state_dict().items()}
    value_before = [p.clone() for p in agent.value_parameters()]
    cfg = stage3.Stage3Config(minibatch_size=5, update_epochs=2)
    opt_a = torch.optim.Adam(agent.policy_parameters(), 1e-3)
    opt_c = torch.optim.Adam(agent.value_parameters(), 1e-3)
    stats = ppo.ppo_update(agent, fake_batch(agent, obs), opt_a, opt_c, cfg, train_policy=False)
    assert all(torch.equal(before[k], v) for k, v in agent.actor.state_dict().items())
    assert any(not torch.equal(a, b) for a, b in zip(value_before, agent.value_parameters()))
    assert "policy_loss" not in stats and stats["value_loss"] > 0
    ppo.ppo_update(agent, fake_batch(agent, obs), opt_a, opt_c, cfg, train_policy=True)
    assert any(not torch.equal(before[k], v) for k, v in agent.actor.state_dict().items())


@pytest.mark.parametrize("freeze", [True, False])
def test_a_frozen_obs_encoder_stays_as_stage_1_left_it_while_ppo_moves_the_rest_of_the_net(freeze):
    policy, dataset = tiny_policy(obs_emb_dim=8)
    cfg = stage3.Stage3Config(num_inference_steps=4, value_hidden_dims=[16], minibatch_size=5, update_epochs=2,
                                  freeze_obs_encoder=freeze)
    agent = stage3.make_agent(policy, cfg)
    obs = torch.stack([dataset[i][0] for i in range(5)])
    encoder, rest = agent.actor.base.obs_encoder, agent.actor.base.down
    assert {id(p) for p in encoder.parameters()}.isdisjoint(map(id, agent.policy_parameters())) is freeze
    before = [p.clone() for p in (*encoder.parameters(), *rest.parameters())]
    opt_a = torch.optim.Adam(agent.policy_parameters(), 1e-3)
    opt_c = torch.optim.Adam(agent.value_parameters(), 1e-3)
    ppo.ppo_update(agent, fake_batch(agent, obs), opt_a, opt_c, cfg)
    n = len(list(encoder.parameters()))
    moved = [not torch.equal(a, b) for a, b in zip(before, (*encoder.parameters(), *rest.parameters()))]
    assert any(moved[:n]) is not freeze and any(moved[n:])  # unfrozen, PPO moves the encoder too


def test_freezing_an_obs_encoder_that_is_not_there_is_a_clear_error(tmp_path):
    cfg = stage3.Stage3Config(num_inference_steps=4, freeze_obs_encoder=True)
    with pytest.raises(ValueError, match="needs a velocity net with an obs_encoder.*obs_emb_dim > 0"):
        stage3.make_agent(tiny_policy()[0], cfg)
    path = tmp_path / "stage1.pt"  # and before a run starts, from its start checkpoint
    bc.save_checkpoint(path, tiny_policy()[0], None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    problem = stage3.start_problem(dataclasses.replace(cfg, init_checkpoint=str(path)))
    assert "has no obs_encoder" in problem and "-p obs_emb_dim=64" in problem
    with_encoder = tmp_path / "stage1_enc.pt"
    bc.save_checkpoint(with_encoder, tiny_policy(obs_emb_dim=8)[0], None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet"), {})
    assert stage3.start_problem(dataclasses.replace(cfg, init_checkpoint=str(with_encoder))) == ""
    with pytest.raises(ValueError, match="steer 'latent' with learner 'ppo' does not read freeze_obs_encoder .ChainConfig"):
        stage3.Stage3Config(steer="latent", freeze_obs_encoder=True)


def test_gae_matches_a_hand_worked_example_with_a_termination_and_a_truncation():
    # one env, 4 decisions: d0 normal; d1 terminates mid-chunk (tau=3); d2 normal; d3 truncated (time limit)
    g, lam = 0.9, 0.5
    R = torch.tensor([[1.0], [2.0], [0.5], [1.5]])
    V = torch.tensor([[10.0], [20.0], [30.0], [40.0]])
    next_V = torch.tensor([[20.0], [99.0], [40.0], [7.0]])  # 99: after the termination, must be ignored
    disc = torch.tensor([[g ** 8], [g ** 3], [g ** 8], [g ** 8]])
    terminal = torch.tensor([[False], [True], [False], [False]])
    ends = torch.tensor([[False], [True], [False], [True]])
    adv, ret = advantages.gae(R, V, next_V, disc, terminal, ends, lam)
    d3 = 1.5 + g ** 8 * 7.0 - 40.0                 # truncation bootstraps from V(last obs)
    d2 = 0.5 + g ** 8 * 40.0 - 30.0
    d1 = 2.0 - 20.0                                  # termination: no bootstrap
    d0 = 1.0 + g ** 8 * 20.0 - 10.0
    A3 = d3
    A2 = d2 + g ** 8 * lam * A3
    A1 = d1                                          # the recursion stops at the episode end
    A0 = d0 + g ** 8 * lam * A1
    assert torch.allclose(adv.squeeze(1), torch.tensor([A0, A1, A2, A3]), atol=1e-5)
    assert torch.allclose(ret, adv + V)


@pytest.mark.parametrize("kind, expected", [
    ("constant", (0.3, 0.3, 0.3)),
    ("linear", (0.3, 0.155, 0.01)),
    ("exp", (0.3, 0.01 + 0.29 * math.exp(-1.5), 0.01 + 0.29 * math.exp(-3))),
])
def test_noise_schedules_at_start_half_and_end(kind, expected):
    got = [loop.noise_schedule(kind, p, 0.3, 0.01) for p in (0.0, 0.5, 1.0)]
    assert got == pytest.approx(expected)
    assert loop.noise_schedule(kind, 2.0, 0.3, 0.01) == pytest.approx(expected[2])  # past the end: held
    with pytest.raises(ValueError, match="noise schedule"):
        loop.noise_schedule("cosine", 0.5, 0.3, 0.01)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="noise_schedule"):
        stage3.Stage3Config(noise_schedule="cosine")
    with pytest.raises(ValueError, match="min_noise_std"):
        stage3.Stage3Config(min_noise_std=0.5, max_noise_std=0.3)
    with pytest.raises(ValueError, match="val_seed .* overlap"):
        stage3.Stage3Config(val_seed=20_000 - 10, num_eval_episodes=48)
    with pytest.raises(ValueError, match="'act_horizon' = -1: should be greater than or equal to 0"):
        stage3.Stage3Config(act_horizon=-1)
    with pytest.raises(ValueError, match="actor_optimizer must be 'adam' or 'sgd'"):
        stage3.Stage3Config(actor_optimizer="rmsprop")
    for wrong in ({"advantage": "branch"}, {"branches": 2}):  # one without the other
        with pytest.raises(ValueError, match="advantage 'branch' goes with branches >= 2"):
            stage3.Stage3Config(**wrong)


def test_observations_far_outside_the_demonstrations_are_clipped_before_the_nets():
    agent, obs = tiny_agent(K=4)
    norm = agent.obs_normalizer
    far, edge = obs.clone(), obs.clone()
    far[:, :, 0] = norm.shift[0] + 1000 * norm.scale[0]   # a tipped cube: 1000 std from the demonstrations
    edge[:, :, 0] = norm.shift[0] + 5 * norm.scale[0]     # the clip
    x0 = torch.randn(5, 16, ACT_DIM, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(agent.value(far), agent.value(edge))
        assert torch.allclose(agent.act(far, x0=x0), agent.act(edge, x0=x0))
        agent.obs_clip = 0.0  # off: the nets see the 1000 std
        assert not torch.allclose(agent.value(far), agent.value(edge))
    with pytest.raises(ValueError, match="'obs_clip' = -1.0: should be greater than or equal to 0"):
        stage3.Stage3Config(obs_clip=-1.0)


def test_a_checkpoint_loads_as_it_ran_unclipped_from_before_obs_clip_and_takes_checked_overrides(tmp_path):
    policy, _ = tiny_policy()
    cfg = stage3.Stage3Config(num_inference_steps=4, value_hidden_dims=[16])
    agent = stage3.make_agent(policy, cfg)
    config = dataclasses.asdict(cfg)
    del config["obs_clip"]
    path = tmp_path / "old.pt"
    torch.save({"format": loop.CHECKPOINT_FORMAT, "meta": agent.meta, "config": config,
                "agent": agent.state_dict()}, path)
    assert stage3.load_agent(path).obs_clip == 0.0
    config["obs_clip"] = 5.0
    torch.save({"format": loop.CHECKPOINT_FORMAT, "meta": agent.meta, "config": config,
                "agent": agent.state_dict()}, path)
    assert stage3.load_agent(path).obs_clip == 5.0
    # the same weights, sampled and scored another way; a misspelt key names the right one
    assert stage3.load_agent(path, {"noise_corr": 0.9}).noise_corr == 0.9
    with pytest.raises(ConfigError, match="did you mean 'noise_corr'"):
        stage3.load_agent(path, {"noise_cor": 0.9})


def test_chain_of_wrong_shape_is_rejected():
    agent, obs = tiny_agent(K=4)
    with pytest.raises(ValueError, match=r"chain must be \[B, 5, 16, 4\]"):
        agent.log_prob(obs, torch.zeros(5, 9, 16, ACT_DIM))
    with pytest.raises(ValueError, match="max_steps"):
        reinflow_agent.ReinFlowAgent(tiny_policy()[0], num_inference_steps=16)  # ShortCut trained for 8
    with pytest.raises(ValueError, match=r"act_horizon=16 is outside \[1, 15\]"):
        reinflow_agent.ReinFlowAgent(tiny_policy()[0], num_inference_steps=4, act_horizon=16)  # H 16 - To 2 + 1


PIRL = {"noise_method": "flow_sde", "hybrid": True, "advantage": "grpo", "ratio_mode": "per_step",
        "critic_input": "velocity_features", "dual_clip": 3.0, "huber_delta": 1.0, "act_horizon": 4,
        "reward": "dense"}  # a random tiny policy never succeeds: with sparse rewards every GRPO advantage is 0


BRANCH = {"advantage": "branch", "branches": 2, "reward": "dense", "success_bonus": 1.0, "actor_optimizer": "sgd",
          "policy_epochs": 1}


LATENT = {"steer": "latent", "max_noise_std": 1.0, "final_noise_std": 1.0, "latent_hidden_dims": [16]}


RESIDUAL = {"steer": "residual", "residual_per": "chunk", "reward": "shaped", "residual_hidden_dims": [16]}


FROZEN = {"freeze_obs_encoder": True}  # from a stage-1 policy with an obs_encoder (obs_emb_dim 8)


def _fine_tune(tmp_path, monkeypatch, options):
    """A tiny stage-1 policy, then two iterations of stage 3 with ``options`` in a real PickCube env (2 envs)."""
    eval_seeds = []  # periodic evaluations must use val_seed: eval_seed is kept for the report
    bc_evaluate = bc.evaluate
    monkeypatch.setattr(bc, "evaluate", lambda *a, seed, **kw: eval_seeds.append(seed) or bc_evaluate(*a, seed=seed, **kw))
    frozen = options.get("freeze_obs_encoder", False)
    policy, dataset = tiny_policy(obs_emb_dim=8 if frozen else 0)
    path = tmp_path / "stage1.pt"
    bc.save_checkpoint(path, policy, None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    # GRPO runs one 20-step episode per env per iteration: ceil(20 / 4) = 5 decisions of 4 actions
    Ta = options.get("act_horizon", 8)
    per_iter = (3 if Ta == 8 else 5) * 2 * Ta * options.get("branches", 1)  # every branch's env steps count
    cfg = stage3.Stage3Config(init_checkpoint=str(path), num_inference_steps=4, rollout_steps=3, update_epochs=2,
                                  minibatch_size=4, total_env_steps=2 * per_iter, critic_warmup_steps=0,
                                  max_episode_steps=20, eval_every=1, num_eval_episodes=2, value_hidden_dims=[16],
                                  **options)
    with make_env("PickCube-v1", 2, max_episode_steps=20) as env:
        agent, how = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
        before = [p.clone() for p in agent.policy_parameters()]
        encoder = agent.actor.base.obs_encoder.state_dict() if frozen else {}
        encoder = {k: v.clone() for k, v in encoder.items()}
        tracker = Tracker(tmp_path / "run")
        out = stage3.train(cfg, agent, env, tmp_path / "run", tracker)
    return SimpleNamespace(stage1=path, last=tmp_path / "run" / "last.pt", cfg=cfg, agent=agent, how=how, out=out,
                           rows=tracker.rows, before=before, encoder=encoder, eval_seeds=eval_seeds, Ta=Ta,
                           per_iter=per_iter)


@pytest.fixture(scope="module")
def reinflow_run(tmp_path_factory):
    """Plain chain ReinFlow's two-iteration PickCube run, trained once for the tests of the benchmarks that read it."""
    with pytest.MonkeyPatch.context() as mp:
        yield _fine_tune(tmp_path_factory.mktemp("reinflow"), mp, {})


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gradient_snr(checkpoint, tmp_path, monkeypatch) -> dict:
    """The gradient-SNR benchmark on ``checkpoint``: 2 rollouts x 2 envs = 4 independent units, over what PPO moves."""
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    load_benchmark("gradient_snr").main([str(checkpoint), "--rollouts", "2", "--num-envs", "2", "--decisions", "3"])
    return json.loads((tmp_path / "outputs" / "benchmarks" / "gradient_snr" / "default.json").read_text())


@pytest.mark.sim
@pytest.mark.parametrize("options", [{}, PIRL, BRANCH, LATENT, RESIDUAL, FROZEN],
                         ids=["reinflow", "flow_sde_hybrid_grpo", "branch", "latent", "residual", "frozen_obs_encoder"])
def test_two_iterations_fine_tune_in_a_real_pickcube_env(tmp_path, monkeypatch, request, options):
    r = request.getfixturevalue("reinflow_run") if not options else _fine_tune(tmp_path, monkeypatch, options)
    cfg, agent, rows, per_iter = r.cfg, r.agent, r.rows, r.per_iter
    assert r.how == "fresh"
    assert r.out["iterations"] == 2 and len(rows) == 2 and r.out["env_steps"] == 2 * per_iter
    assert {"policy_loss", "value_loss", "approx_kl", "clip_frac", "explained_variance", "noise_std",
            "rollout_time", "update_time", "env_steps_per_s"} <= set(rows[-1])
    assert "eval/success_once" in rows[0] and rows[-1]["episodes"] >= 1  # 20-step episodes end within an iteration
    # PickCube's failure breakdown, in training (noise on) and in the periodic evaluations
    assert {"train/is_grasped_once", "train/is_obj_placed_once", "eval/is_grasped_once"} <= set(rows[0])
    assert r.eval_seeds == [cfg.val_seed]  # after iteration 1 (not after the last one)
    assert any(not torch.equal(a, b.cpu()) for a, b in zip(r.before, agent.policy_parameters()))  # on a GPU, moved
    ckpt = stage3.read_agent_checkpoint(r.last)
    assert ckpt["iteration"] == 2 and ckpt["env_steps"] == 2 * per_iter
    assert bool(ckpt["actor_opt"]["state"]) is (cfg.actor_optimizer == "adam")  # plain SGD keeps no moments
    reloaded = stage3.load_agent(r.last)
    assert reloaded.act_horizon == agent.act_horizon == r.Ta  # the override travels with the checkpoint
    for k, v in r.encoder.items():  # frozen: the encoder of the run and of its checkpoint is stage 1's
        assert torch.equal(agent.actor.base.obs_encoder.state_dict()[k].cpu(), v.cpu())
        assert torch.equal(reloaded.actor.base.obs_encoder.state_dict()[k], v.cpu())
    window = torch.randn(3, 2, OBS_DIM)
    assert torch.equal(reloaded.act(window, generator=torch.Generator().manual_seed(0)),
                       agent.cpu().act(window, generator=torch.Generator().manual_seed(0)))  # trained on the GPU if any
    with pytest.raises(ValueError, match="not a stage-3 checkpoint"):
        stage3.read_agent_checkpoint(r.stage1)
    if options is FROZEN:  # the gradient-SNR benchmark leaves the frozen encoder out of its modules
        result = gradient_snr(r.last, tmp_path, monkeypatch)
        assert "velocity.obs_encoder" not in result and result["units"] == 4


@pytest.mark.sim
def test_the_gradient_snr_benchmark_sums_the_velocity_nets_modules(reinflow_run, tmp_path, monkeypatch):
    result = gradient_snr(reinflow_run.last, tmp_path, monkeypatch)
    assert result["units"] == 4 and result["decisions"] == 12
    modules = [k for k in result if k.startswith("velocity.")]
    assert {"velocity.down", "velocity.final"} <= set(modules)
    # the velocity net's Gram matrix is the sum of its modules': so are its signal and noise
    for key in ("signal", "noise"):
        assert result["velocity"][key] == pytest.approx(sum(result[m][key] for m in modules), rel=1e-6, abs=1e-9)


@pytest.mark.sim
def test_the_branch_calibration_benchmark_scores_each_pair_by_critic_and_rollouts(reinflow_run, tmp_path, monkeypatch):
    """2 branch points x 2 envs, each pair scored by the critic and by Monte-Carlo rollouts to the episode's end (a
    branch point after 0 or 1 decisions: every env is live)."""
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    out = load_benchmark("branch_calibration").main([str(reinflow_run.last), "--batches", "2", "--num-envs", "2",
                                                     "--max-skip", "1"])
    assert out["pairs"] == 4 and out["std_dq"] > 0
    assert (tmp_path / "outputs" / "benchmarks" / "branch_calibration" / "default.json").exists()


@pytest.mark.sim
def test_the_ppo_step_benchmark_times_the_whole_batch_and_its_slices(reinflow_run, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    rows = load_benchmark("ppo_update_speed").main([str(reinflow_run.last), "--rows", "8", "--micro", "0", "3",
                                                    "--repeats", "1"])
    assert [r["micro_batch_size"] for r in rows] == [0, 3] and [r["rows"] for r in rows] == [8, 8]
    assert all(r["ms_per_row"] == pytest.approx(1e3 * r["s_per_step"] / 8) for r in rows)


def test_the_policy_throughput_benchmark_has_a_row_per_k_and_batch(tmp_path, monkeypatch):
    """Env steps served = batch x Ta per chain."""
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    path = tmp_path / "stage1.pt"
    bc.save_checkpoint(path, tiny_policy()[0], None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    rows = load_benchmark("policy_throughput").main(["--checkpoint", str(path), "--batch", "2", "4",
                                                     "--K", "2", "4", "--repeats", "1"])
    assert [(r["K"], r["batch"]) for r in rows] == [(2, 2), (2, 4), (4, 2), (4, 4)]
    for r in rows:
        assert r["policy_env_steps_per_s"] == pytest.approx(r["batch"] * 8 * 1e3 / r["sample_ms"])  # Ta = 8
        assert r["peak_memory_mb"] > 0
    assert (tmp_path / "outputs" / "benchmarks" / "policy_throughput" / "default.json").exists()


@pytest.mark.sim
def test_evaluate_noisy_runs_the_stage3_chain_and_leaves_stage1_deterministic(reinflow_run, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    assert evaluate.main([str(reinflow_run.stage1), str(reinflow_run.last), "--noisy", "--episodes", "2",
                          "--num-envs", "2", "--max-episode-steps", "10", "--run-name", "noisy"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "outputs" / "evaluate" / "noisy" / "results.csv")))
    assert [r["policy"] for r in rows] == [f"{reinflow_run.stage1.parent.name}/stage1.pt", "run/last.pt@noisy"]


@pytest.mark.sim
def test_the_sim_step_profile_splits_a_real_pickcube_step_into_parts_that_add_up(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    spec = importlib.util.spec_from_file_location("sim_step_profile", REPO / "benchmarks" / "sim_step_profile.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {r["part"]: r for r in bench.main(["--steps", "6", "--repeats", "3"])}
    assert list(rows) == [*bench.PARTS, "other", "step"]
    # each part is reached, once per env step, PhysX's 5 substeps (100 Hz sim, 20 Hz control): the resets' own calls
    # to these parts are not counted
    assert {p: rows[p]["calls_per_step"] for p in bench.PARTS} == {**dict.fromkeys(bench.PARTS, 1), "physics": 5}
    assert rows["other"]["ms_per_step"] >= 0
    assert sum(rows[p]["ms_per_step"] for p in (*bench.PARTS, "other")) == pytest.approx(rows["step"]["ms_per_step"],
                                                                                          abs=0.01)
    assert rows["step"]["share"] == 1.0
    assert (tmp_path / "outputs" / "benchmarks" / "sim_step_profile" / "default.json").exists()
    with pytest.raises(SystemExit, match="--steps and --repeats must be >= 1"):
        bench.main(["--steps", "0"])


def test_finish_episodes_is_the_discounted_rest_of_the_episode_bootstrapped_at_the_time_limit():
    """From step 0 of a 20-step episode (chunks of 8, 8 and 4 executed steps): G = sum_k gamma^k r_(k+1)
    + gamma^20 V(last window), whatever actions the policy takes; an ended episode then adds nothing."""
    agent, _ = tiny_agent()
    gamma, limit = 0.9, 20
    runner = smdp.ChunkRunner(SolvedFromStep(5, limit), obs_horizon=2, gamma=gamma, reward="dense")
    g = reinflow.finish_episodes(agent, runner, torch.Generator().manual_seed(0))
    last = torch.stack([torch.full((OBS_DIM,), float(limit - 1)), torch.full((OBS_DIM,), float(limit))])[None]
    expected = sum(gamma ** k * (1.0 if k + 1 >= 5 else 0.5) for k in range(limit)) \
        + gamma ** limit * agent.value(last).item()
    assert g.item() == pytest.approx(expected, rel=1e-5)
    assert not runner.active.any() and [e["length"] for e in runner.pop_finished()] == [limit]
    assert reinflow.finish_episodes(agent, runner).item() == 0.0


@pytest.mark.parametrize("per_iteration, counts", [(4096, [0, 1, 1, 2, 3]), (16384, [0, 1, 1, 1, 1])])
def test_critic_warmup_covers_the_first_n_env_steps_in_whole_iterations(per_iteration, counts):
    """ceil(N / steps per iteration) value-only iterations: the policy learns from none of the first N
    env steps, and a warm-up shorter than one iteration is one iteration, not none."""
    for n, expected in zip([0, 2000, 4096, 5000, 10000], counts):
        cfg = stage3.Stage3Config(critic_warmup_steps=n)
        warm = [loop.in_critic_warmup(i * per_iteration, cfg) for i in range(6)]
        assert warm == [True] * expected + [False] * (6 - expected), (n, per_iteration)


def test_the_flipped_advantage_control_takes_the_exact_opposite_first_step():
    """``flip_advantages`` (the control of a learning run): with one minibatch, no entropy bonus and Adam's first step
    (``lr * sign(g)``), the policy moves by exactly the negative of the plain update."""
    import copy

    from flowlib.rl.buffers import RolloutBuffer
    from flowlib.rl.learners import PPOLearner

    agent, obs = tiny_agent()
    b = fake_batch(agent, obs)
    buf = RolloutBuffer(obs=obs[None], chains=b["chains"][None], stochastic=b["stochastic"][None],
                        step_log_probs=b["step_log_probs"][None], log_probs=b["log_probs"][None],
                        values=torch.zeros(1, 5), rewards=torch.randn(1, 5, generator=torch.Generator().manual_seed(1)),
                        discounts=torch.full((1, 5), 0.9), next_values=torch.zeros(1, 5),
                        terminal=torch.zeros(1, 5, dtype=torch.bool), ends=torch.ones(1, 5, dtype=torch.bool),
                        weights=torch.ones(1, 5))
    moves = []
    for flip in (False, True):
        cfg = stage3.Stage3Config(minibatch_size=5, update_epochs=1, ent_coef=0.0, flip_advantages=flip)
        copy_ = copy.deepcopy(agent)
        before = [p.clone() for p in copy_.policy_parameters()]
        learner = PPOLearner(copy_, cfg, make_rollout=None)
        learner.build_optimizers()
        learner.gen = torch.Generator().manual_seed(0)
        learner.update(buf, train_policy=True)
        moves.append(torch.cat([(p - q).flatten() for p, q in zip(copy_.policy_parameters(), before)]))
    assert moves[0].abs().max() > 0
    assert torch.allclose(moves[1], -moves[0], atol=1e-7)
