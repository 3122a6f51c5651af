"""Per-step residual TD3 (flowlib.methods.residual_step): the stage-1 policy at the start, TD3's target, the actor moving to
the correction that pays with the flow untouched, the collector's transitions chaining step to step, what is
refused, and a real PickCube run that evaluates with the correction in the loop and resumes with its replay."""
import copy
import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from test_reinflow import ACT_DIM, OBS_DIM, tiny_policy

from flowlib.envs import smdp
from flowlib.envs.maniskill import make_env
from flowlib.flows.distributions import LOG_2PI
from flowlib.flows.nets import frozen, mlp
from flowlib.infra.tracking import Tracker
from flowlib.methods import reinflow, stage3
from flowlib.methods.residual_step import StepCollector, StepResidualAgent
from flowlib.methods.residual_step_ppo import StepResidualPPOAgent
from flowlib.methods.residual_td3 import (
    StepResidualTD3Agent,
    actor_lr,
    bound_scale,
    optimizers,
    replay_buffer,
    td3_update,
)
from flowlib.policies import bc
from flowlib.rl.buffers import NStepReturns
from flowlib.rl.ppo import ppo_update

TD3 = {"steer": "residual_step", "learner": "td3", "reward": "shaped", "max_noise_std": 0.05, "final_noise_std": 0.05,
       "min_noise_std": 0.005, "residual_hidden_dims": [16], "value_hidden_dims": [32, 32]}


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_agent(bound=0.5, cls=StepResidualTD3Agent, **kwargs):
    policy, dataset = tiny_policy()
    agent = cls(policy, 4, min_noise_std=0.005, max_noise_std=0.05, value_hidden_dims=(32, 32), residual_bound=bound,
                residual_hidden=(16,), **kwargs)
    obs = torch.stack([dataset[i][0] for i in range(5)])
    return agent, obs, policy


def test_at_the_start_the_policy_is_the_stage1_policy_and_the_correction_is_zero():
    agent, obs, policy = step_agent()
    x0 = torch.randn(5, 16, ACT_DIM, generator=torch.Generator().manual_seed(0))
    chunk = agent.act(obs, x0=x0)                                                     # [B, Ta, A]
    assert torch.allclose(chunk, policy.act(obs, 4, x0=x0).clamp(-1, 1), atol=1e-6)  # the env clips to its box
    a = chunk[:, 0]
    assert torch.allclose(agent.correct_step(obs, a), a, atol=1e-5)
    agent.explore = torch.Generator().manual_seed(1)  # --noisy: the exploration noise, std 0.05 in normalised units
    moved = agent.action_normalizer.normalize(agent.correct_step(obs, a)) - agent.action_normalizer.normalize(a)
    assert 0 < moved.abs().max() <= 0.5 + 1e-6


def test_the_critics_fit_the_td3_target():
    agent, obs, _ = step_agent()
    cfg = stage3.Stage3Config(**{k: v for k, v in TD3.items() if k != "reward"}, td3_target_noise=0.0, target_tau=1e-4)
    with torch.no_grad():  # a residual actor away from zero, so the target's mu_bar(s') matters
        agent.residual_target[-1].bias.normal_(0, 1.0)
    g = torch.Generator().manual_seed(0)
    batch = {"obs": obs, "latent": 0.1 * torch.randn(5, ACT_DIM, generator=g), "reward": torch.randn(5, generator=g),
             "bootstrap": torch.tensor([0.99, 0.0, 0.99, 0.99, 0.0]), "next_obs": obs.flip(0),
             "base": torch.randn(5, ACT_DIM, generator=g), "next_base": torch.randn(5, ACT_DIM, generator=g)}
    with torch.no_grad():
        s_next = agent.state(batch["next_obs"], batch["next_base"])
        r_next = agent.residual_bound * torch.tanh(agent.residual_target(s_next))
        q_in = torch.cat([s_next, r_next / agent.residual_bound], 1)  # the critics see r / b
        q_next = torch.minimum(*[net(q_in).squeeze(-1) for net in agent.q_target.nets])
        y = batch["reward"] + batch["bootstrap"] * q_next
    actor_opt, critic_opt = optimizers(agent, cfg)
    losses = [td3_update(agent, batch, actor_opt, critic_opt, cfg, train_policy=False) for _ in range(300)]
    assert losses[0]["target"] == pytest.approx(y.mean().item(), abs=1e-5)
    assert losses[-1]["value_loss"] < 1e-2 * losses[0]["value_loss"]
    with torch.no_grad():  # Q_bar moved by ~3% of the way (tau 1e-4 x 300): y barely changed
        q = agent.critic(agent.state(obs, batch["base"]), batch["latent"])
    assert torch.allclose(q, y.expand(2, 5), atol=0.05)
    # Q_bar follows Q in critic-only steps too (a warm-up against a target frozen at its random start fits noise),
    # while mu_bar waits for the actor
    actor_target = [p.clone() for p in agent.residual_target.parameters()]
    td3_update(agent, batch, actor_opt, critic_opt, dataclasses.replace(cfg, target_tau=1.0), train_policy=False)
    assert all(torch.equal(a, b) for a, b in zip(agent.q.parameters(), agent.q_target.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(actor_target, agent.residual_target.parameters()))


def test_the_polyak_step_moves_every_target_tensor_a_fraction_tau_of_the_way_and_the_actor_only_when_asked():
    agent, _, _ = step_agent()
    with torch.no_grad():  # targets apart from the nets, so that the step shows
        for p in list(agent.q_target.parameters()) + list(agent.residual_target.parameters()):
            p.add_(1.0)
    q_bar, mu_bar = [p.clone() for p in agent.q_target.parameters()], [p.clone() for p in agent.residual_target.parameters()]
    agent.update_targets(0.25, actor=False)
    for p, old, new in zip(agent.q.parameters(), q_bar, agent.q_target.parameters()):
        assert torch.allclose(new, old + 0.25 * (p - old), atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(mu_bar, agent.residual_target.parameters()))
    agent.update_targets(0.25)
    for p, old, new in zip(agent.residual_net.parameters(), mu_bar, agent.residual_target.parameters()):
        assert torch.allclose(new, old + 0.25 * (p - old), atol=1e-6)


def test_the_actor_moves_to_the_correction_that_pays_and_leaves_the_flow_as_it_was():
    agent, obs, _ = step_agent(bound=0.5)
    cfg = stage3.Stage3Config(**{k: v for k, v in TD3.items() if k != "reward"}, actor_lr=1e-3, critic_lr=3e-3,
                                  target_tau=0.05)
    flow = [p.clone() for p in agent.flow.net.parameters()]
    best = torch.tensor([0.3, -0.2, 0.1, 0.0])  # a one-step bandit: reward -|r - best|^2, no bootstrap
    g = torch.Generator().manual_seed(0)
    actor_opt, critic_opt = optimizers(agent, cfg)
    for i in range(1200):  # the critics alone first (a warm-up), then the actor every second step
        r = torch.rand(64, ACT_DIM, generator=g) - 0.5                                # uniform in the bound
        rows = torch.randint(5, (64,), generator=g)
        base = torch.randn(64, ACT_DIM, generator=g)
        batch = {"obs": obs[rows], "latent": r, "reward": -(r - best).pow(2).sum(1), "bootstrap": torch.zeros(64),
                 "next_obs": obs[rows], "base": base, "next_base": base}
        td3_update(agent, batch, actor_opt, critic_opt, cfg, train_policy=i >= 400 and i % 2 == 1)
    with torch.no_grad():
        mu = agent.residual(agent.state(obs, torch.randn(5, ACT_DIM, generator=g)))
    # near the best correction everywhere, not at the bound's corners (where a critic's linear slope would drive it)
    assert torch.allclose(mu.mean(0), best, atol=0.08) and torch.allclose(mu, best.expand(5, -1), atol=0.12), mu
    assert all(torch.equal(a, b) for a, b in zip(flow, agent.flow.net.parameters()))


def test_the_actor_follows_the_gradient_of_q1_alone_and_leaves_the_critics_gradients_as_their_own_loss_left_them():
    agent, obs, _ = step_agent(bound=0.5)
    cfg = stage3.Stage3Config(**{k: v for k, v in TD3.items() if k != "reward"}, td3_target_noise=0.0,
                                  max_grad_norm=1e6)  # no clipping: the raw gradients are compared
    with torch.no_grad():  # an actor and critics away from their start, so that every gradient is non-zero
        agent.residual_net[-1].weight.normal_(0, 0.3)
        agent.q.nets[1][-1].weight.mul_(-3.0)  # Q_2 sloped unlike Q_1 ...
        agent.q.nets[1][-1].bias.sub_(50.0)  # ... and below it everywhere: a min over the two would follow Q_2
    g = torch.Generator().manual_seed(0)
    batch = {"obs": obs, "latent": 0.1 * torch.randn(5, ACT_DIM, generator=g), "reward": torch.randn(5, generator=g),
             "bootstrap": torch.full((5,), 0.8), "next_obs": obs.flip(0), "base": torch.randn(5, ACT_DIM, generator=g),
             "next_base": torch.randn(5, ACT_DIM, generator=g)}
    critic_only = copy.deepcopy(agent)
    td3_update(agent, batch, *optimizers(agent, cfg), cfg, train_policy=True)
    td3_update(critic_only, batch, *optimizers(critic_only, cfg), cfg, train_policy=False)
    for with_actor, alone in zip(agent.q.parameters(), critic_only.q.parameters()):
        assert torch.equal(with_actor.grad, alone.grad)  # the actor's loss added nothing to the critics' gradients
    # the deterministic policy gradient, computed apart on the critics as the critic step left them: Q_1 only
    net, q1 = critic_only.residual_net, critic_only.q.nets[0]
    s = critic_only.state(obs, batch["base"])
    mu = agent.residual_bound * torch.tanh(net(s))
    loss = -q1(torch.cat([s, mu / agent.residual_bound], 1)).mean() + cfg.residual_l2 * (mu / agent.residual_bound).pow(2).mean()
    expected = torch.autograd.grad(loss, list(net.parameters()))
    for p, e in zip(agent.residual_net.parameters(), expected):
        assert torch.allclose(p.grad, e, atol=1e-6), (p.grad - e).abs().max()
    assert all(p.requires_grad for p in agent.q.parameters())  # unfrozen after the actor's step


def test_frozen_stops_the_weight_gradients_passes_the_input_gradient_and_restores_the_flags_even_on_error():
    net = mlp([3, 8, 1])
    net[0].bias.requires_grad_(False)  # frozen before: stays frozen after
    x = torch.randn(4, 3, requires_grad=True)
    with frozen(net):
        y = net(x).sum()
    y.backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in net.parameters())
    with pytest.raises(RuntimeError, match="inside"):
        with frozen(net):
            raise RuntimeError("inside")
    assert [p.requires_grad for p in net.parameters()] == [True, False, True, True]


def n_step_stream(T, N, g=0.8, seed=0):
    """T steps of N envs: rewards, ``gamma (1 - terminal)``, ends (a truncation keeps gamma) and numbered windows."""
    gen = torch.Generator().manual_seed(seed)
    end = torch.rand(T, N, generator=gen) < 0.15
    terminal = end & (torch.rand(T, N, generator=gen) < 0.5)
    steps = [{"obs": torch.full((N, 1), float(t)), "latent": torch.full((N, 1), float(t)), "base": torch.zeros(N, 1),
              "reward": torch.randn(N, generator=gen), "bootstrap": g * (~terminal[t]).float(), "end": end[t],
              "next_obs": torch.full((N, 1), t + 1.0), "next_base": torch.full((N, 1), t + 1.0)} for t in range(T)]
    return steps


def test_n_step_returns_sum_rewards_up_to_n_steps_or_the_episode_end():
    g = 0.8
    steps = n_step_stream(4, 2, g)
    for s in steps:
        s["reward"], s["bootstrap"], s["end"] = torch.ones(2), torch.full((2,), g), torch.zeros(2, dtype=torch.bool)
    steps[1]["end"][0] = True                            # env 0: truncated after step 1 (bootstraps from its window)
    steps[2]["end"][1], steps[2]["bootstrap"][1] = True, 0.0  # env 1: terminated at step 2
    acc = NStepReturns(3)
    assert acc.push(**steps[0]) == [] and acc.push(**steps[1]) == []
    (first,) = acc.push(**steps[2])
    assert torch.allclose(first["reward"], torch.tensor([1 + g, 1 + g + g * g]))
    assert torch.allclose(first["bootstrap"], torch.tensor([g * g, 0.0]))   # env 1's termination: no bootstrap
    assert first["next_obs"].flatten().tolist() == [2.0, 3.0] and first["obs"].flatten().tolist() == [0.0, 0.0]
    (second,) = acc.push(**steps[3])                     # from step 1: env 0 ends at once, env 1 at step 2
    assert torch.allclose(second["reward"], torch.tensor([1.0, 1 + g])) and second["next_obs"].flatten().tolist() == [2.0, 3.0]
    assert torch.allclose(second["bootstrap"], torch.tensor([g, 0.0]))
    rest = acc.flush()                                   # steps 2 and 3, cut where the stream stops
    assert [r["obs"][0].item() for r in rest] == [2.0, 3.0] and acc.pending == []
    assert torch.allclose(rest[0]["reward"], torch.tensor([1 + g, 1.0])) and rest[0]["next_obs"].flatten().tolist() == [4.0, 3.0]
    assert torch.allclose(rest[0]["bootstrap"], torch.tensor([g * g, 0.0]))
    with pytest.raises(ValueError, match="td3_n_step must be >= 1"):
        NStepReturns(0)
    with pytest.raises(ValueError, match="'td3_n_step' = 0: should be greater than 0"):
        stage3.Stage3Config(steer="residual_step", learner="td3", td3_n_step=0)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_n_step_returns_match_a_per_env_loop(n):
    T, N, g = 40, 3, 0.8
    steps = n_step_stream(T, N, g, seed=n)
    acc = NStepReturns(n)
    rows = [row for s in steps for row in acc.push(**s)] + acc.flush()
    assert [r["obs"][0].item() for r in rows] == list(range(T))
    for t, row in enumerate(rows):
        for i in range(N):  # walk env i forward from step t until n steps, its episode's end or the stream's end
            ret, disc, k = 0.0, 1.0, t
            while True:
                ret += disc * steps[k]["reward"][i].item()
                disc *= steps[k]["bootstrap"][i].item()
                if steps[k]["end"][i] or k == t + n - 1 or k == T - 1:
                    break
                k += 1
            assert row["reward"][i].item() == pytest.approx(ret, abs=1e-5)
            assert row["bootstrap"][i].item() == pytest.approx(disc, abs=1e-6)
            assert row["next_obs"][i].item() == k + 1 and row["next_base"][i].item() == k + 1
    if n == 1:  # one step: the transitions pass through unchanged
        assert all(torch.equal(r["reward"], s["reward"]) and torch.equal(r["bootstrap"], s["bootstrap"])
                   for r, s in zip(rows, steps))


def test_without_the_gripper_the_residual_its_noise_and_its_target_smoothing_leave_the_last_dim_alone():
    policy, dataset = tiny_policy()
    agent = StepResidualTD3Agent(policy, 4, max_noise_std=0.05, value_hidden_dims=(32, 32), residual_bound=0.5,
                              residual_hidden=(16,), correct_gripper=False)
    obs = torch.stack([dataset[i][0] for i in range(5)])
    with torch.no_grad():
        agent.residual_net[-1].bias.fill_(1.0)  # a correction on every dim, were it allowed
    a = torch.zeros(5, ACT_DIM)  # inside the action box, so nothing is clipped
    agent.explore = torch.Generator().manual_seed(1)
    moved = agent.action_normalizer.normalize(agent.correct_step(obs, a)) - agent.action_normalizer.normalize(a)
    assert (moved[:, :-1].abs() > 0.1).all() and torch.allclose(moved[:, -1], torch.zeros(5), atol=1e-5)
    cfg = stage3.Stage3Config(**{k: v for k, v in TD3.items() if k != "reward"}, residual_gripper=False)
    assert stage3.make_agent(policy, cfg).residual_mask.tolist() == [1.0] * (ACT_DIM - 1) + [0.0]  # the config's way in
    assert stage3.make_agent(policy, dataclasses.replace(cfg, residual_gripper=True)).residual_mask.min() == 1.0
    actor_opt, critic_opt = optimizers(agent, cfg)
    base = torch.randn(5, ACT_DIM)
    batch = {"obs": obs, "latent": agent.residual(agent.state(obs, base)), "reward": torch.ones(5),
             "bootstrap": torch.full((5,), 0.8), "next_obs": obs, "base": base, "next_base": base}
    assert (batch["latent"][:, -1] == 0).all()
    td3_update(agent, batch, actor_opt, critic_opt, cfg)
    assert (agent.residual(agent.state(obs, base))[:, -1] == 0).all()
    with pytest.raises(ValueError, match="steer 'chain' with learner 'ppo' does not read residual_gripper .ResidualConfig"):
        stage3.Stage3Config(residual_gripper=False)


def test_what_has_no_meaning_for_a_per_step_residual_is_refused():
    with pytest.raises(ValueError, match="steer 'residual' with learner 'td3' is not a stage-3 method"):
        stage3.Stage3Config(learner="td3", steer="residual")
    with pytest.raises(ValueError, match="residual_step' with learner 'ppo' takes advantage gae / mc / nstep.*'grpo'"):
        stage3.Stage3Config(steer="residual_step", advantage="grpo")
    with pytest.raises(ValueError, match="one Gaussian per env step.*log_prob_reduce must be 'sum'"):
        StepResidualPPOAgent(tiny_policy()[0], 4, log_prob_reduce="mean_dim")
    with pytest.raises(ValueError, match="'td3_policy_delay' = 0: should be greater than 0"):
        stage3.Stage3Config(steer="residual_step", learner="td3", td3_policy_delay=0)
    with pytest.raises(ValueError, match="residual_bound must be > 0"):
        step_agent(bound=0.0)
    with pytest.raises(ValueError, match="no chain log-prob.*hybrid must be False"):
        StepResidualTD3Agent(tiny_policy()[0], 4, hybrid=True)
    agent, _, _ = step_agent()
    with pytest.raises(ValueError, match="lacks the fields \\['base', 'next_base'\\]"):
        replay_buffer(agent, 8).load_state_dict(  # a DSRL-SAC replay has no base actions
            {"capacity": 8, "ptr": 0, "size": 0, **{k: torch.zeros(0) for k in
                                                     ("obs", "latent", "reward", "bootstrap", "next_obs")}})


def test_the_actor_lr_ramps_from_zero_past_the_critic_warmup_and_only_td3_has_the_ramp():
    cfg = stage3.Stage3Config(critic_warmup_steps=1000, actor_lr=1e-4, actor_lr_warmup_steps=4000, **TD3)
    assert [actor_lr(cfg, n) for n in (0, 1000)] == [0.0, 0.0]
    assert actor_lr(cfg, 3000) == pytest.approx(5e-5) and actor_lr(cfg, 5000) == actor_lr(cfg, 10**6) == 1e-4
    assert actor_lr(dataclasses.replace(cfg, actor_lr_warmup_steps=0), 0) == 1e-4  # no ramp: full at once
    with pytest.raises(ValueError, match="'actor_lr_warmup_steps' = -1: should be greater than or equal to 0"):
        dataclasses.replace(cfg, actor_lr_warmup_steps=-1)
    with pytest.raises(ValueError, match="with learner 'ppo' does not read actor_lr_warmup_steps .TD3Config, read by steer/learner residual_step/td3"):
        stage3.Stage3Config(actor_lr_warmup_steps=4000)


def test_the_bound_grows_from_zero_past_the_critic_warmup_and_caps_the_residual():
    cfg = stage3.Stage3Config(critic_warmup_steps=1000, residual_bound_warmup_steps=4000, **TD3)
    assert [bound_scale(cfg, n) for n in (0, 1000, 3000, 5000)] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert bound_scale(dataclasses.replace(cfg, residual_bound_warmup_steps=0), 0) == 1.0  # no ramp: full at once
    agent, obs, _ = step_agent(bound=0.5)
    with torch.no_grad():
        agent.residual_net[-1].bias.fill_(10.0)  # tanh saturated: mu = b on every dim
    s = agent.state(obs, torch.zeros(5, ACT_DIM))
    assert torch.allclose(agent.residual(s), torch.full((5, ACT_DIM), 0.5))
    agent.set_bound_scale(0.25)
    assert torch.allclose(agent.residual(s), torch.full((5, ACT_DIM), 0.125))  # capped at 0.25 b
    assert torch.allclose(agent.residual(s, target=True), torch.zeros(5, ACT_DIM))  # the target actor: still at zero
    r = torch.full((5, ACT_DIM), 0.25)  # the critics read r / b at the full bound, whatever the scale
    assert torch.equal(agent.critic(s, r)[0], agent.q.nets[0](torch.cat([s, r / 0.5], 1)).squeeze(-1))
    state = agent.state_dict()
    assert state["bound_scale"].item() == 0.25  # kept in the checkpoint: a resumed run goes on at its scale
    older = {k: v for k, v in state.items() if k != "bound_scale"}  # written before the scale existed
    fresh, _, _ = step_agent(bound=0.5)
    fresh.set_bound_scale(0.0)
    fresh.load_state_dict(older)
    assert fresh.bound_scale.item() == 1.0  # such a run's actor ran at the full bound
    with pytest.raises(ValueError, match="bound scale must lie in \\[0, 1\\], got 1.5"):
        agent.set_bound_scale(1.5)
    with pytest.raises(ValueError, match="with learner 'ppo' does not read residual_bound_warmup_steps"):
        stage3.Stage3Config(residual_bound_warmup_steps=4000)


def gradient_snr_of(run: Path, monkeypatch, tmp_path) -> dict:
    """``benchmarks/gradient_snr.py`` on ``run``'s last.pt: 2 rollouts x 2 envs x 5 env steps, 4 units."""
    import json

    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    args = [str(run / "last.pt"), "--rollouts", "2", "--num-envs", "2", "--decisions", "5"]
    load_benchmark("gradient_snr").main(args)
    return json.loads((tmp_path / "outputs" / "benchmarks" / "gradient_snr" / "default.json").read_text())


@pytest.mark.sim
def test_td3_runs_in_a_real_pickcube_env_and_its_transitions_chain_step_to_step(tmp_path, monkeypatch):
    policy, _ = tiny_policy()
    path = tmp_path / "stage1.pt"
    bc.save_checkpoint(path, policy, None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    per_iter = 3 * 8 * 2  # 2 envs x 3 chunks x 8 steps
    cfg = stage3.Stage3Config(init_checkpoint=str(path), num_inference_steps=4, rollout_steps=3, max_episode_steps=20,
                                  total_env_steps=2 * per_iter, critic_warmup_steps=per_iter, replay_batch_size=8,
                                  replay_updates_per_decision=0.25, eval_every=1, num_eval_episodes=2,
                                  actor_lr_warmup_steps=2 * per_iter, residual_bound_warmup_steps=2 * per_iter, **TD3)
    run = tmp_path / "run"
    with make_env("PickCube-v1", 2, max_episode_steps=20) as env:
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
        assert isinstance(agent, StepResidualAgent)
        before = [p.clone() for p in agent.policy_parameters()]
        tracker = Tracker(run)
        out = stage3.train(cfg, agent, env, run, tracker)
        rows = tracker.rows
        assert out["env_steps"] == 2 * per_iter and [r["critic_warmup"] for r in rows] == [1.0, 0.0]
        assert [r["updates"] for r in rows] == [12, 12] and [r["buffer"] for r in rows] == [48, 96]
        assert [r["actor_lr"] for r in rows] == pytest.approx([0.0, 0.5 * cfg.actor_lr])  # half way up the ramp
        assert [r["bound_scale"] for r in rows] == pytest.approx([0.0, 0.5])  # ... and up the bound's
        assert "policy_loss" not in rows[0] and {"policy_loss", "value_loss", "q", "residual_rms",
                                                 "eval/success_once", "train/success_once"} <= set(rows[0]) | set(rows[1])
        assert any(not torch.equal(a, b.cpu()) for a, b in zip(before, agent.policy_parameters()))  # on a GPU, moved
        assert stage3.read_agent_checkpoint(run / "last.pt")["replay"]["size"] == 96
        assert stage3.load_agent(run / "last.pt").bound_scale.item() == 0.5  # the checkpoint keeps the scale
        longer = stage3.checkpoint_config(stage3.read_agent_checkpoint(run / "last.pt"),
                                            {"total_env_steps": 3 * per_iter})
        agent2, _ = stage3.build_agent(longer, stage3.init_checkpoint_path(longer), env.spec)
        resumed = Tracker(run)
        assert stage3.train(longer, agent2, env, run, resumed)["env_steps"] == 3 * per_iter
        assert resumed.rows[-1]["actor_lr"] == pytest.approx(cfg.actor_lr)  # past the ramp: the full rate
        assert resumed.rows[-1]["bound_scale"] == 1.0  # ... and the full bound
        assert stage3.read_agent_checkpoint(run / "last.pt")["replay"]["size"] == 144

        # the collector's transitions: each step's (window, a_b) is the previous step's (next window, a_b')
        # unless the episode ended, and what ran is a_b + r
        runner = smdp.ChunkRunner(env, agent.obs_horizon, 0.99, "shaped", first_seed=123)
        buffer = replay_buffer(agent, 100)
        agent.set_bound_scale(1.0)  # the full bound (training left it half way up its ramp)
        with torch.no_grad():  # a constant residual that is not zero, so a_b + r differs from a_b
            agent.residual_net[-1].weight.zero_()
            agent.residual_net[-1].bias.fill_(0.2)
        StepCollector(agent, runner, torch.Generator().manual_seed(0)).collect(buffer, 30)  # 20-step episodes end
        d = {k: v[:60].view(30, 2, *v.shape[1:]) for k, v in buffer.data.items()}        # [T, N, ...]
        ended = d["bootstrap"][:-1] == 0  # terminations; truncations bootstrap, so find the ends from the windows
        same = (d["next_obs"][:-1] == d["obs"][1:]).flatten(2).all(2)
        assert same.sum() >= 2 * 29 - 4 and not (ended & same).any()  # at most two episode ends per env
        chained = (d["next_base"][:-1] - d["base"][1:]).abs().amax(2) < 1e-5
        assert (chained | ~same).all()
        assert torch.allclose(d["latent"].mean((0, 1)), torch.full((ACT_DIM,), 0.5 * torch.tanh(torch.tensor(0.2))),
                              atol=0.03)

        # the same rollout again with 3-step returns: each row sums the one-step rewards above up to 3 steps or the
        # episode's end, and bootstraps from the window there
        runner3 = smdp.ChunkRunner(env, agent.obs_horizon, 0.99, "shaped", first_seed=123)
        buffer3 = replay_buffer(agent, 100)
        StepCollector(agent, runner3, torch.Generator().manual_seed(0), n_step=3).collect(buffer3, 30)
        d3 = {k: v[:56].view(28, 2, *v.shape[1:]) for k, v in buffer3.data.items()}   # 2 steps still pending
        assert len(buffer3) == 56 and torch.equal(d3["obs"], d["obs"][:28]) and torch.equal(d3["latent"], d["latent"][:28])
        goes_on = torch.cat([same.float(), torch.zeros(1, 2)])                          # [T, N]: step t+1 continues t
        ret, disc, alive = torch.zeros(28, 2), torch.ones(28, 2), torch.ones(28, 2)
        for k in range(3):
            ret += alive * disc * d["reward"][k:k + 28]
            last = alive.bool()
            disc = torch.where(last, disc * d["bootstrap"][k:k + 28], disc)
            alive = alive * goes_on[k:k + 28]
        assert torch.allclose(d3["reward"], ret, atol=1e-5) and torch.allclose(d3["bootstrap"], disc, atol=1e-6)
    reloaded = stage3.load_agent(run / "last.pt")
    assert isinstance(reloaded, StepResidualAgent)
    window = torch.randn(3, 2, OBS_DIM)
    a = torch.zeros(3, ACT_DIM)
    agent2 = agent2.eval().cpu()  # trained on the GPU if any
    assert torch.equal(reloaded.correct_step(window, a), agent2.correct_step(window, a))
    # the gradient-SNR benchmark on it: TD3's actor gradient through Q_1, one per env's 5 steps, over mu's weights
    result = gradient_snr_of(run, monkeypatch, tmp_path)
    assert result["learner"] == "td3" and result["units"] == 4 and result["decisions"] == 20
    assert result["explained_variance"] is None and set(result) & {"velocity", "noise"} == set()
    assert result["residual"]["params"] == sum(p.numel() for p in reloaded.policy_parameters())
    assert result["residual"]["noise"] > 0  # units see different states, so their gradients differ


def test_the_update_speed_benchmark_times_each_adam_on_a_params_files_agent(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    policy, _ = tiny_policy()
    path = tmp_path / "stage1.pt"
    bc.save_checkpoint(path, policy, None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    params = tmp_path / "td3.yaml"
    params.write_text("\n".join(f"{k}: {v}" for k, v in {**TD3, "init_checkpoint": str(path), "replay_batch_size": 8,
                                                          "replay_updates_per_decision": 0.5, "total_env_steps": 4000}.items()))
    rows = load_benchmark("td3_update_speed").main(["--params", str(params), "--adam", "loop", "fused", "--updates",
                                                     "4", "--repeats", "2"])
    assert [r["adam"] for r in rows] == ["loop", "fused"]
    for r in rows:  # the run's update time is its steps at the measured time each
        assert r["run_update_min"] == pytest.approx(r["ms_per_step"] * r["steps_per_run"] / 6e4, abs=0.05)
        assert r["ms_spread"] >= 0 and r["batch"] == 8
    assert rows[0]["steps_per_run"] == 2000  # 0.5 steps per env step x 4000
    assert (tmp_path / "outputs" / "benchmarks" / "td3_update_speed" / "default.json").exists()
    ppo = tmp_path / "ppo.yaml"
    ppo.write_text(f"init_checkpoint: {path}\n")
    with pytest.raises(SystemExit, match="steer: residual_step"):
        load_benchmark("td3_update_speed").main(["--params", str(ppo)])


def test_the_nudge_benchmark_moves_the_gripper_towards_the_goal_only_while_grasped():
    bench = load_benchmark("closed_loop_nudge")
    policy, _ = tiny_policy()
    obs = torch.zeros(2, 2, 42)                                   # PickCube's 42-dim state layout, two envs
    obs[:, -1, 26:29] = torch.tensor([0.1, 0.0, 0.2])            # goal
    obs[:, -1, 29:32] = torch.tensor([0.0, 0.0, 0.02])           # cube
    obs[:, -1, 39:42] = obs[:, -1, 26:29] - obs[:, -1, 29:32]    # obj_to_goal
    obs[0, -1, 18] = 1.0                                          # env 0 holds the cube, env 1 does not
    a = torch.full((2, 4), 0.1)
    nudged = bench.Corrected(policy, "nudge", 0.5).correct_step(obs, a)
    assert torch.allclose(nudged[0, :3], torch.tensor([0.1 + 0.5, 0.1, 0.1 + 0.9]).clamp(max=1.0))
    assert torch.equal(nudged[1], a[1]) and nudged[0, 3] == a[0, 3]  # not grasped: unchanged; the gripper: unchanged
    biased = bench.Corrected(policy, "bias", 0.04, axis=1).correct_step(obs, a)
    norm = policy.action_normalizer
    assert torch.allclose(norm.normalize(biased) - norm.normalize(a), torch.tensor([0.0, 0.04, 0.0, 0.0]).expand(2, 4),
                          atol=1e-6)
    with pytest.raises(ValueError, match="PickCube-v1 state observations"):
        bench.Corrected(policy, "nudge", 0.5).correct_step(torch.ones(2, 2, OBS_DIM), a)  # obj_to_goal != goal - obj


def test_the_grasp_failure_benchmark_reads_when_the_gripper_closes_and_how_far_off_it_is():
    import numpy as np

    from flowlib.envs.data import Episode
    bench = load_benchmark("grasp_failures")
    T = 6
    obs = torch.zeros(T + 1, 42)                                        # PickCube's 42-dim state layout
    obs[:, 29:32] = torch.tensor([0.0, 0.0, 0.02])                     # the cube stays put
    obs[:, 19:22] = torch.tensor([-0.04, 0.01, 0.02]) + torch.linspace(0.05, 0.0, T + 1)[:, None] * torch.tensor([0, 0, 1.0])
    obs[:, 36:39] = obs[:, 29:32] - obs[:, 19:22]                     # tcp_to_obj: cube minus gripper
    obs[:, 39:42] = obs[:, 26:29] - obs[:, 29:32]                     # obj_to_goal
    actions = torch.ones(T, 4)
    actions[4:, 3] = -1.0                                               # the gripper closes at step 4, 4 cm beside the cube
    ep = Episode(obs.numpy(), actions.numpy(), np.zeros(T), np.zeros(T, bool), np.zeros(T, bool), np.zeros(T, bool), 7)
    r = bench.episode_report(ep, grasped=False, look_at=2)
    assert r["close_step"] == 4 and r["first_grasp_step"] is None and r["seed"] == 7 and not r["success"]
    assert r["offset_at_close_cm"] == [4.0, -1.0, pytest.approx(-100 * 0.05 * 2 / 6, abs=0.05)]
    assert r["offset_at_2_cm"][:2] == [4.0, -1.0] and r["min_distance_cm"] == pytest.approx(100 * 0.0017 ** 0.5, abs=0.05)
    obs[3:, 18] = 1.0                                                   # grasped from the observation after step 2
    r = bench.episode_report(Episode(obs.numpy(), actions.numpy(), np.zeros(T), np.zeros(T, bool), np.zeros(T, bool),
                                     np.zeros(T, bool), 7), grasped=True, look_at=2)
    assert r["first_grasp_step"] == 3
    with pytest.raises(ValueError, match="not cube minus gripper"):
        obs[:, 36] += 0.1
        bench.episode_report(Episode(obs.numpy(), actions.numpy(), np.zeros(T), np.zeros(T, bool), np.zeros(T, bool),
                                     np.zeros(T, bool), 7), grasped=True, look_at=2)


def test_the_carry_report_tells_a_slip_from_a_dropped_cube_and_from_one_held_off_the_goal():
    import numpy as np

    from flowlib.envs.data import Episode
    bench = load_benchmark("grasp_failures")
    T = 6
    obs = torch.zeros(T + 1, 42)
    obs[:, 26:29] = torch.tensor([0.0, 0.0, 0.10])                     # the goal, 10 cm up
    obs[:, 29:32] = torch.tensor([0.0, 0.0, 0.02])
    obs[3, 29:32] = torch.tensor([0.0, 0.03, 0.035])                   # after step 3: 1.5 cm up, 7.2 cm from the goal
    obs[:, 39:42] = obs[:, 26:29] - obs[:, 29:32]
    obs[0, 18] = 1.0                                                    # the reset obs: the previous episode's flag
    obs[2:5, 18] = 1.0                                                  # grasped after steps 2-4, lost at step 5
    episode = lambda o, success: Episode(o.numpy(), np.zeros((T, 4)), np.zeros(T), success, success,  # noqa: E731
                                         np.zeros(T, bool), 11)
    c = bench.carry_report(episode(obs, np.zeros(T, bool)))               # never 2 cm up: the grasp slipped
    assert c["outcome"] == "slipped" and c["grasp_lost"] and c["grasped_steps"] == 3 and c["first_grasp_step"] == 2
    assert c["lost_at_step"] == 5 and c["offset_at_closest_cm"] == [0.0, -3.0, 6.5]
    assert c["closest_to_goal_cm"] == pytest.approx(100 * (0.03 ** 2 + 0.065 ** 2) ** 0.5, abs=0.05)
    assert c["counted_steps"] == 0 and c["max_rise_cm"] == pytest.approx(1.5)  # fingers shut: the reward never counted it
    fingers = obs.clone()
    fingers[3, 7:9] = 0.02                                              # 4 cm apart after step 3 only
    assert bench.carry_report(episode(fingers, np.zeros(T, bool)))["counted_steps"] == 1
    assert bench.carry_report(episode(fingers, np.zeros(T, bool)), min_gap=0.045)["counted_steps"] == 0
    assert bench.counted_to_lift(episode(fingers, np.zeros(T, bool)), 0.035) == 0  # counted with the cube 1.5 cm up
    fingers[2:5, 7:9] = 0.02                                            # counted after steps 2-4, 1 cm up after step 3
    assert bench.counted_to_lift(episode(fingers, np.zeros(T, bool)), 0.035) == 1
    fingers[3, 31] = 0.025                                              # only 0.5 cm up: never the first centimetre
    assert bench.counted_to_lift(episode(fingers, np.zeros(T, bool)), 0.035) is None
    obs[4, 31] = 0.05                                                   # after step 4 the cube is 3 cm up, grasped
    obs[:, 39:42] = obs[:, 26:29] - obs[:, 29:32]
    assert bench.lifted(obs).tolist() == [False, False, False, True, False, False]
    assert bench.carry_report(episode(obs, np.zeros(T, bool)))["outcome"] == "dropped"
    obs[2:, 18] = 1.0                                                   # held to the end
    c = bench.carry_report(episode(obs, np.zeros(T, bool)))
    assert c["outcome"] == "held" and not c["grasp_lost"] and c["lost_at_step"] is None and c["grasped_steps"] == 5
    with pytest.raises(ValueError, match="succeeds"):
        bench.carry_report(episode(obs, np.arange(T) == 4))
    obs[:, 18] = 0.0
    obs[0, 18] = 1.0                                                    # only the stale reset flag: never grasped
    with pytest.raises(ValueError, match="never grasps"):
        bench.carry_report(episode(obs, np.zeros(T, bool)))


@pytest.mark.sim
def test_the_episode_layout_benchmark_reads_the_layouts_the_evaluation_met_and_splits_by_them(tmp_path):
    import pandas as pd

    bench = load_benchmark("episode_layout")
    seeds = list(range(30000, 30004))
    with make_env("PickCube-v1", 4, control_mode="pd_ee_delta_pos") as env:  # as flowlib.policies.bc.evaluate resets them
        obs = env.reset(seed=seeds).cpu()                                      # [4, 42]
    lay = bench.layouts(seeds)                                                  # one env, one seed at a time
    assert torch.allclose(torch.tensor(lay[["cx", "cy"]].values, dtype=torch.float32), obs[:, 29:31], atol=1e-6)
    assert torch.allclose(torch.tensor(lay[["gx", "gy", "gz"]].values, dtype=torch.float32), obs[:, 26:29], atol=1e-6)
    assert lay.gz.between(0.0, 0.4).all() and lay.cy.abs().max() <= 0.1

    d = pd.DataFrame({"env_seed": range(6), "policy": "p", "cy": [-0.05, -0.02, -0.01, 0.03, 0.04, 0.06],
                      "gz": [0.03, 0.04, 0.15, 0.15, 0.25, 0.25], "success": [0, 0, 1, 1, 1, 0],
                      "is_grasped": [False, True, True, True, True, True],
                      "is_obj_placed": [False, False, True, True, True, False]})
    t = bench.tables(d)["p"]
    assert t["halves"]["y<0"] == {"episodes": 3, "grasped": pytest.approx(2 / 3), "success": pytest.approx(1 / 3)}
    assert t["halves"]["y>=0"] == {"episodes": 3, "grasped": 1.0, "success": pytest.approx(2 / 3)}
    by_z = t["placed_given_grasped_by_goal_z"]  # the ungrasped episode (gz 0.03) is left out
    assert by_z["(0.0, 0.05]"] == {"grasped": 1, "placed": 0.0} and by_z["(0.1, 0.2]"] == {"grasped": 2, "placed": 1.0}
    assert by_z["(0.2, 0.3]"] == {"grasped": 2, "placed": 0.5} and by_z["(0.3, 0.4]"] == {"grasped": 0, "placed": None}
    with pytest.raises(FileNotFoundError, match="run `python -m flowlib.evaluate"):
        bench.episodes(tmp_path / "nowhere")


# --------------------------------------------------------------------------- learner "ppo"

PPO_STEP = {**{k: v for k, v in TD3.items() if k != "learner"}, "learner": "ppo", "ent_coef": 0.0}


def test_ppo_scores_r_with_the_exact_gaussian_on_the_arm_dims_and_draws_it_unclipped():
    agent, obs, policy = step_agent(bound=0.1, cls=StepResidualPPOAgent, correct_gripper=False)
    with torch.no_grad():
        agent.residual_net[-1].bias.fill_(3.0)  # mu near the bound b = 0.1 on every dim it acts on
    base = torch.rand(5, ACT_DIM) * 2 - 1
    s = agent.state(obs, base)
    mu = agent.residual(s)
    r = agent.explore_noise(mu.expand(400, 5, ACT_DIM).reshape(2000, ACT_DIM), torch.Generator().manual_seed(0))
    assert (r[:, -1] == 0).all() and (r[:, :-1].abs() > agent.residual_bound).any()  # the gripper alone; not clipped
    s_rep = s.repeat(400, 1)
    step_lp, entropy = agent.residual_log_probs(s_rep, r[:, None])
    closed = torch.distributions.Normal(mu.repeat(400, 1)[:, :-1], 0.05).log_prob(r[:, :-1]).sum(1)
    assert step_lp.shape == (2000, 1) and torch.allclose(step_lp[:, 0], closed, atol=1e-5)
    assert torch.allclose(entropy, torch.full((2000,), 0.5 * (1 + LOG_2PI) + math.log(0.05)))
    assert torch.allclose(agent.joint_log_prob(step_lp, torch.ones(2000, 1, dtype=torch.bool), r[:, None]), closed,
                          atol=1e-5)
    view = agent.ppo_view()  # what ppo_update scores decisions with: V(s) of the state, r's log-prob
    assert view.value(s).shape == (5,) and set(view.value_parameters()).isdisjoint(view.policy_parameters())
    assert torch.equal(view.step_log_probs(s_rep, r[:, None])[0], step_lp)
    # a frozen flow plus the residual and its critic: none of the chain agent's nets rides along unused
    assert {name for name, _ in agent.named_children()} == {"flow", "residual_net", "state_value"}


def test_the_per_step_policy_gradient_is_the_score_of_the_gaussian_on_the_arm_dims_weighted_by_the_advantage():
    """``reinflow.policy_gradient`` through ``ppo_view`` (what the SNR benchmark measures) against
    ``torch.distributions.Normal``'s log-prob of ``r`` on the dims it acts on."""
    agent, obs, _ = step_agent(bound=0.3, cls=StepResidualPPOAgent, correct_gripper=False)
    torch.nn.init.normal_(agent.residual_net[-1].weight, std=0.1)  # mu != 0 and depends on the weights
    s = agent.state(obs, torch.rand(5, ACT_DIM) * 2 - 1).repeat(4, 1)                     # [20, S]
    with torch.no_grad():
        r = agent.explore_noise(agent.residual(s), torch.Generator().manual_seed(0))      # [20, A]
    adv = torch.randn(20, generator=torch.Generator().manual_seed(1))
    params = agent.policy_parameters()
    grad = reinflow.policy_gradient(agent.ppo_view(), s, r[:, None], torch.ones(20, 1, dtype=torch.bool), adv,
                                    params)
    log_prob = torch.distributions.Normal(agent.residual(s)[:, :-1], 0.05).log_prob(r[:, :-1]).sum(1)
    closed = torch.autograd.grad(-(adv * log_prob).mean(), params)
    assert grad.abs().max() > 0 and torch.allclose(grad, torch.cat([g.flatten() for g in closed]), atol=1e-5)


def test_ppo_moves_the_per_step_mean_towards_the_correction_that_pays_and_leaves_the_flow_as_it_was():
    """A one-step bandit over the residual's state: reward = -|r - c|^2 for a fixed c inside the bound."""
    agent, obs, policy = step_agent(bound=0.5, cls=StepResidualPPOAgent)
    flow_before = copy.deepcopy(policy.flow.net.state_dict())
    cfg = stage3.Stage3Config(**PPO_STEP, update_epochs=4, minibatch_size=64, actor_lr=3e-3, critic_lr=1e-3)
    actor_opt = torch.optim.Adam(agent.policy_parameters(), lr=cfg.actor_lr)
    critic_opt = torch.optim.Adam(agent.value_parameters(), lr=cfg.critic_lr)
    gen = torch.Generator().manual_seed(0)
    s = agent.state(obs, torch.zeros(5, ACT_DIM)).repeat(52, 1)                        # [260, S]
    c = torch.tensor([0.2, -0.1, 0.15, 0.0])
    assert (agent.residual(s) == 0).all()
    for _ in range(30):
        with torch.no_grad():
            r = agent.explore_noise(agent.residual(s), gen)
            step_lp, _ = agent.residual_log_probs(s, r[:, None])
            reward = -(r - c).pow(2).sum(1)
        batch = {"obs": s, "chains": r[:, None], "stochastic": torch.ones(len(s), 1, dtype=torch.bool),
                 "step_log_probs": step_lp, "log_probs": step_lp[:, 0], "values": agent.ppo_view().value(s).detach(),
                 "advantages": reward - reward.mean(), "returns": reward}
        stats = ppo_update(agent.ppo_view(), batch, actor_opt, critic_opt, cfg, generator=gen)  # checks ratio == 1
    gap = (agent.residual(s) - c).norm(dim=1).mean().item()
    assert gap < 0.5 * c.norm().item() and stats["policy_steps"] > 0
    assert all(torch.equal(v, policy.flow.net.state_dict()[k]) for k, v in flow_before.items())


@pytest.mark.sim
def test_ppo_on_the_per_step_residual_runs_in_a_real_pickcube_env_every_step_a_decision(tmp_path, monkeypatch):
    policy, _ = tiny_policy()
    path = tmp_path / "stage1.pt"
    bc.save_checkpoint(path, policy, None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    per_iter = 3 * 8 * 2  # 2 envs x 3 chunks x 8 steps
    cfg = stage3.Stage3Config(init_checkpoint=str(path), num_inference_steps=4, rollout_steps=3,
                                  max_episode_steps=20, total_env_steps=2 * per_iter, critic_warmup_steps=per_iter,
                                  minibatch_size=16, eval_every=1, num_eval_episodes=2, gamma=0.8, gae_lambda=0.9,
                                  **PPO_STEP)
    run = tmp_path / "run"
    with make_env("PickCube-v1", 2, max_episode_steps=20) as env:
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
        assert type(agent) is StepResidualPPOAgent
        before = [p.clone() for p in agent.policy_parameters()]
        tracker = Tracker(run)
        out = stage3.train(cfg, agent, env, run, tracker)
        rows = tracker.rows
        assert out["env_steps"] == 2 * per_iter and [r["critic_warmup"] for r in rows] == [1.0, 0.0]
        assert "policy_loss" not in rows[0] and rows[1]["policy_steps"] > 0
        assert rows[1]["noise_std"] == pytest.approx(0.05, rel=1e-4)  # sigma: the schedule, as the entropy says
        logged = set(rows[0]) | set(rows[1])
        assert {"value_loss", "explained_variance", "eval/success_once", "train/success_once"} <= logged
        assert any(not torch.equal(a, b.cpu()) for a, b in zip(before, agent.policy_parameters()))
        longer = stage3.checkpoint_config(stage3.read_agent_checkpoint(run / "last.pt"),
                                            {"total_env_steps": 3 * per_iter})
        agent2, _ = stage3.build_agent(longer, stage3.init_checkpoint_path(longer), env.spec)
        resumed = Tracker(run)
        assert stage3.train(longer, agent2, env, run, resumed)["env_steps"] == 3 * per_iter
        assert [r["iteration"] for r in resumed.rows] == [3]  # on from iteration 2

        # a rollout: 30 steps of 2 envs, each a decision [T, N]; the next state's value is the next decision's
        # unless the episode ended, its log-prob is the Gaussian's now (PPO's ratio starts at 1), and what ran is
        # a_b + r with r drawn around mu
        with torch.no_grad():
            agent.residual_net[-1].weight.zero_()
            agent.residual_net[-1].bias.fill_(0.2)
        agent.set_max_noise_std(0.05)
        runner = smdp.ChunkRunner(env, agent.obs_horizon, 0.8, "shaped", first_seed=123)
        buf = StepCollector(agent, runner, torch.Generator().manual_seed(0), n_step=0).rollout(30)
        assert buf.rewards.shape == (30, 2) and buf.chains.shape == (30, 2, 1, ACT_DIM) and buf.ends.sum() >= 2
        goes_on = ~buf.ends[:-1]
        assert torch.allclose(buf.next_values[:-1][goes_on], buf.values[1:][goes_on], atol=1e-6)
        assert torch.equal(buf.discounts, torch.where(buf.terminal, 0.0, 0.8))
        s, r = buf.obs.flatten(0, 1), buf.chains.flatten(0, 1)
        step_lp, _ = agent.cpu().residual_log_probs(s, r)
        assert torch.allclose(step_lp[:, 0], buf.log_probs.flatten(), atol=1e-5)
        mean_r = r[:, 0].mean(0)
        assert torch.allclose(mean_r, torch.full((ACT_DIM,), 0.5 * math.tanh(0.2)), atol=0.02)
    reloaded = stage3.load_agent(run / "last.pt")
    assert type(reloaded) is StepResidualPPOAgent
    window, a = torch.randn(3, 2, OBS_DIM), torch.zeros(3, ACT_DIM)
    agent2 = agent2.eval().cpu()
    assert torch.equal(reloaded.correct_step(window, a), agent2.correct_step(window, a))
    # the gradient-SNR benchmark on it: PPO's likelihood-ratio gradient of r's Gaussian, GAE from V(s)
    result = gradient_snr_of(run, monkeypatch, tmp_path)
    assert result["learner"] == "ppo" and result["units"] == 4 and result["decisions"] == 20
    assert -1 <= result["explained_variance"] <= 1 and "velocity" not in result
    assert result["residual"]["params"] == sum(p.numel() for p in reloaded.policy_parameters())
    assert result["residual"]["noise"] > 0
