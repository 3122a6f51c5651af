"""Chain ReinFlow learns: on the fast reach task, a short seeded run of PPO through the denoising chain lifts a
cloned policy by a margin many standard errors wide, and the same run on flipped advantages makes it worse.

The whole pipeline at small size: scripted demos, ShortCut BC with an MLP velocity net, then stage 3 through
``flowlib.methods.stage3`` (``params/03_reinflow/fast_reach.yaml``'s batch of 2,560 decisions, ``fast_reach_mlp.yaml``'s learning rate), each policy scored on the
same held-out episodes."""
import dataclasses

import numpy as np
import pytest
import torch

from flowlib.envs.data import ChunkDataset, generate_demos, load_demos
from flowlib.envs.maniskill import make_env
from flowlib.methods import stage3
from flowlib.policies import bc

EPISODES = 512


@pytest.mark.slow
def test_chain_ppo_lifts_a_cloned_policy_and_the_flipped_control_lowers_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    dataset = ChunkDataset(load_demos(generate_demos("FastReach-v0", 500)), 2, 16)
    bc_cfg = bc.ShortCutBCConfig(env_id="FastReach-v0", velocity_net="mlp", mlp_dims=[256, 256], emb_dim=16,
                                 train_steps=1200, batch_size=256, warmup_steps=50, ckpt_every=1200, eval_every=0,
                                 num_eval_episodes=4, num_envs=256, max_episode_steps=40)
    with make_env("FastReach-v0", 256, max_episode_steps=40) as env:
        policy, _ = bc.train(bc_cfg, dataset, tmp_path / "01_shortcut_bc" / "start", env=env)
        start = bc.evaluate(policy, env, EPISODES, 4, seed=50_000)
    after = {}
    for flip in (False, True):
        cfg = stage3.Stage3Config(
            init_checkpoint="01_shortcut_bc/start/best_model.pt", env_id="FastReach-v0", num_envs=256,
            max_episode_steps=40, num_inference_steps=4, log_prob_over="executed_last", max_noise_std=0.1,
            final_noise_std=0.04, min_noise_std=0.02, noise_decay_steps=2_000_000, total_env_steps=1_228_800,
            rollout_steps=10, update_epochs=5, minibatch_size=512, actor_lr=1e-4, critic_lr=1e-3, target_kl=0.05,
            critic_warmup_steps=40_960, value_hidden_dims=[128, 128], flip_advantages=flip, resume=False)
        with make_env("FastReach-v0", 256, max_episode_steps=40) as env:
            agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
            stage3.train(cfg, agent, env, tmp_path / f"flip_{flip}")
            after[flip] = bc.evaluate(agent.cpu(), env, EPISODES, 4, seed=50_000)
    base = np.array(start["per_episode_success_once"], dtype=float)
    for flip, sign in ((False, 1), (True, -1)):
        diff = np.array(after[flip]["per_episode_success_once"], dtype=float) - base  # paired, per episode
        se = diff.std(ddof=1) / np.sqrt(len(diff))
        assert sign * diff.mean() > 4 * se, (flip, start["success_once"], after[flip]["success_once"], se)


def tiny_start(tmp_path, monkeypatch) -> None:
    """A tiny FastReach clone at ``01_shortcut_bc/tiny/best_model.pt`` under ``tmp_path`` (the outputs folder)."""
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    dataset = ChunkDataset(load_demos(generate_demos("FastReach-v0", 20)), 2, 16)
    bc_cfg = bc.ShortCutBCConfig(env_id="FastReach-v0", velocity_net="mlp", mlp_dims=[32, 32], emb_dim=8,
                                 train_steps=20, batch_size=32, warmup_steps=2, ckpt_every=20, eval_every=0,
                                 num_eval_episodes=2, num_envs=2, max_episode_steps=40)
    bc.train(bc_cfg, dataset, tmp_path / "01_shortcut_bc" / "tiny")


def tiny_chain_config(iterations: int, **kw) -> stage3.Stage3Config:
    return stage3.Stage3Config(
        init_checkpoint="01_shortcut_bc/tiny/best_model.pt", env_id="FastReach-v0", num_envs=16,
        max_episode_steps=40, num_inference_steps=2, rollout_steps=5, total_env_steps=iterations * 16 * 5 * 8,
        update_epochs=1, minibatch_size=40, critic_warmup_steps=0, value_hidden_dims=[16], eval_every=0,
        num_eval_episodes=2, **kw)


def test_bc_coeff_pulls_to_the_start_checkpoint_and_logs_the_w2_distance(tmp_path, monkeypatch):
    """``bc_coeff``: the learner reads the start again from ``init_checkpoint`` (the pull is to the stage-1 policy,
    also after a resume), its distance is 0 there, and every trained iteration logs ``bc_loss``."""
    from flowlib.infra.runs import read_metrics
    from flowlib.infra.tracking import Tracker
    tiny_start(tmp_path, monkeypatch)
    cfg = tiny_chain_config(3, bc_coeff=1.0, actor_lr=1e-2)
    run = tmp_path / "03_reinflow" / "bc"
    with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
        learner = stage3.make_learner(agent, cfg)
        window = torch.randn(8, agent.obs_horizon, agent.obs_dim)
        assert torch.equal(learner.regularisers[0].distance(window), torch.zeros(8))
        stage3.train(cfg, agent, env, run, Tracker(run, resume=False))
        moved = stage3.make_learner(agent, cfg).regularisers[0].distance(window, torch.Generator().manual_seed(0))
    rows = [r for r in read_metrics(run) if "bc_loss" in r]
    assert len(rows) == 3 and all(r["bc_loss"] >= 0 for r in rows) and rows[-1]["bc_loss"] > 0
    assert moved.mean() > 0  # the trained agent has left the start the learner reads from the checkpoint
    with pytest.raises(ValueError, match="does not read bc_coeff"):
        stage3.Stage3Config(steer="latent", bc_coeff=1.0)


def test_the_gaussian_baseline_clones_the_start_checkpoints_demos_then_trains_by_ppo(tmp_path, monkeypatch):
    """Steer ``gaussian``: ``build_agent`` clones the mean on the demos the start checkpoint names (its error on them
    falls well below the untrained net's), and a two-iteration PPO run on the real env writes its rows."""
    from flowlib.infra.runs import read_metrics
    from flowlib.infra.tracking import Tracker
    tiny_start(tmp_path, monkeypatch)
    dataset = ChunkDataset(load_demos(generate_demos("FastReach-v0", 20)), 2, 16)
    errors = {}
    for steps in (0, 300):
        cfg = tiny_chain_config(2, steer="gaussian", gaussian_bc_steps=steps, gaussian_hidden_dims=[64, 64],
                                gaussian_bc_batch=128)
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg))
        obs, actions = dataset.tensors(agent.obs_normalizer, agent.action_normalizer)
        with torch.no_grad():
            errors[steps] = (agent.mean(obs.clamp(-5, 5)) - actions).pow(2).mean().item()
    assert errors[300] < 0.5 * errors[0], errors
    run = tmp_path / "03_reinflow" / "gaussian"
    with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
        stage3.train(cfg, agent, env, run, Tracker(run, resume=False))
    rows = [r for r in read_metrics(run) if "policy_loss" in r]
    assert len(rows) == 2 and all(np.isfinite(r["policy_loss"]) for r in rows)
    assert type(stage3.load_agent(run / "last.pt")).__name__ == "GaussianChunkAgent"


@pytest.mark.parametrize("mask", ["success_only", "advantage_topk"])
def test_rfc_reflows_the_velocity_net_on_the_kept_decisions_of_a_real_rollout(tmp_path, monkeypatch, mask):
    """Learner ``rfc``: two iterations on FastReach log the kept share and the reflow loss; the velocity net moves,
    the noise net (no loss of its own here) does not."""
    from flowlib.infra.runs import read_metrics
    from flowlib.infra.tracking import Tracker
    tiny_start(tmp_path, monkeypatch)
    cfg = tiny_chain_config(2, learner="rfc", rfc_mask=mask, rfc_topk=0.3, reward="sparse", actor_lr=1e-3)
    run = tmp_path / "03_reinflow" / f"rfc_{mask}"
    with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
        velocity = [p.detach().clone() for p in agent.actor.base.parameters()]
        noise = [p.detach().clone() for p in agent.actor.noise_net.parameters()]
        stage3.train(cfg, agent, env, run, Tracker(run, resume=False))
    rows = [r for r in read_metrics(run) if "reflow_mask_ratio" in r]
    assert len(rows) == 2 and all(0 <= r["reflow_mask_ratio"] <= 1 for r in rows)
    if mask == "advantage_topk":  # 0.3 of the live decisions, more only by ties
        assert all(0.3 <= r["reflow_mask_ratio"] < 0.4 for r in rows)
    kept = any(r["reflow_mask_ratio"] > 0 for r in rows)  # advantage_topk always keeps; success_only if one succeeded
    assert kept or mask == "success_only"
    # the reflow runs, and moves the velocity net, exactly when the mask kept a decision
    assert any("reflow_loss" in r for r in rows) is kept
    assert any(not torch.equal(a, b) for a, b in zip(velocity, agent.actor.base.parameters())) is kept
    assert all(torch.equal(a, b) for a, b in zip(noise, agent.actor.noise_net.parameters()))


@pytest.mark.parametrize("steer", ["chain", "latent"])
def test_rfc_beside_ppo_runs_two_iterations_logs_its_loss_and_moves_the_flow(tmp_path, monkeypatch, steer):
    """``rfc_lambda`` on FastReach: two iterations of chain PPO / DSRL's PPO over x_0 log ``rfc_loss`` and ``rfc_kept``;
    the flow's net moves (for the latent steer, only the reflow can move it), and the saved checkpoint holds it."""
    from flowlib.infra.runs import read_metrics
    from flowlib.infra.tracking import Tracker
    tiny_start(tmp_path, monkeypatch)
    cfg = tiny_chain_config(2, steer=steer, rfc_lambda=0.05, rfc_mask="advantage_topk", rfc_topk=0.5, actor_lr=1e-3)
    run = tmp_path / "03_reinflow" / f"rfc_lambda_{steer}"
    with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
        net = agent.actor.base if steer == "chain" else agent.flow.net
        before = [p.detach().clone() for p in net.parameters()]
        stage3.train(cfg, agent, env, run, Tracker(run, resume=False))
    rows = [r for r in read_metrics(run) if "rfc_loss" in r]
    assert len(rows) == 2 and all(r["rfc_loss"] > 0 and 0.5 <= r["rfc_kept"] < 0.6 for r in rows)
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))
    saved = stage3.load_agent(run / "last.pt")
    saved_net = saved.actor.base if steer == "chain" else saved.flow.net
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), saved_net.parameters()))


def test_rfc_remembers_the_newest_kept_decisions_waits_for_enough_and_mixes_in_the_starts_demos(tmp_path,
                                                                                              monkeypatch):
    """``rfc_buffer`` keeps the newest kept decisions over iterations, ``rfc_min_kept`` holds the reflow back until
    that many are at hand, ``rfc_demo_fraction`` fills that share of each minibatch with the start's demo windows,
    and the remembered decisions travel with the learner's state (a resumed run has them)."""
    from types import SimpleNamespace

    from flowlib.rl import loop
    tiny_start(tmp_path, monkeypatch)
    cfg = tiny_chain_config(1, learner="rfc", rfc_mask="advantage_positive", reward="sparse", rfc_buffer=5,
                            rfc_min_kept=10**6, rfc_demo_fraction=0.5, actor_lr=1e-3)
    agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg))
    learner = stage3.make_learner(agent, cfg)
    learner.build_optimizers()
    To, O, H, A = agent.obs_horizon, agent.obs_dim, agent.pred_horizon, agent.action_dim
    assert learner.demos["obs"].shape[1:] == (To, O) and learner.demos["chunks"].shape[1:] == (H, A)

    def rollout(first: float, T: int = 2, N: int = 2):  # rows numbered from ``first``, in their last chain state
        rows = first + torch.arange(T * N, dtype=torch.float32).reshape(T, N)
        return SimpleNamespace(rewards=torch.zeros(T, N), obs=rows[..., None, None].expand(T, N, To, O),
                               chains=rows[..., None, None, None].expand(T, N, 3, H, A))

    learner._keep(rollout(0), torch.tensor([True, True, True, False]))        # rows 0, 1, 2
    learner._keep(rollout(10), torch.tensor([True, True, True, True]))        # rows 10-13: 6 kept, the newest 5 stay
    assert learner.kept["chunks"][:, 0, 0].tolist() == [2, 10, 11, 12, 13]
    assert learner.kept["obs"][:, 0, 0].tolist() == [2, 10, 11, 12, 13]

    batches = []
    loss = learner.flow.loss
    monkeypatch.setattr(learner.flow, "loss", lambda chunks, obs: batches.append(chunks.clone()) or loss(chunks, obs=obs))
    learner.gen = torch.Generator().manual_seed(0)
    velocity = [p.detach().clone() for p in agent.actor.base.parameters()]
    learner._reflow()
    (batch,) = batches  # minibatch 40: 20 demo rows, and the 5 remembered decisions in the other 20 places
    assert len(batch) == 25 and sorted(batch[:5, 0, 0].tolist()) == [2, 10, 11, 12, 13]
    demo_rows = learner.demos["chunks"].flatten(1)
    assert all((demo_rows == row.flatten()).all(1).any() for row in batch[5:])
    assert any(not torch.equal(a, b) for a, b in zip(velocity, agent.actor.base.parameters()))
    batches.clear()  # a share that rounds to the whole minibatch still leaves one place for a kept decision
    learner.cfg = dataclasses.replace(cfg, rfc_demo_fraction=0.99)
    learner._reflow()
    assert [len(b) for b in batches] == [40] * 5
    learner.cfg = cfg

    restored = stage3.make_learner(agent, cfg)
    restored.load_state(learner.state(), "last.pt")
    assert torch.equal(restored.kept["chunks"], learner.kept["chunks"])

    # a real rollout: the kept decisions are added, and with fewer than rfc_min_kept at hand the flow is not moved
    with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
        learner.start(loop.learning_runner(cfg, env, To, first_seed=0), torch.Generator().manual_seed(0))
        _, buf, _ = learner.collect()
        before = [p.detach().clone() for p in agent.actor.base.parameters()]
        stats = learner.update(buf, train_policy=True)
    assert stats["reflow_kept"] == 5 and "reflow_loss" not in stats
    assert all(torch.equal(a, b) for a, b in zip(before, agent.actor.base.parameters()))


def test_fql_trains_offline_on_the_start_checkpoints_demos_then_online_from_a_replay_seeded_with_them(tmp_path,
                                                                                                       monkeypatch):
    """Steer ``one_step`` / learner ``fql``: ``build_agent`` runs the offline phase once (marked in the weights), the
    online replay starts with the demo decisions, and two online iterations write their rows and a checkpoint."""
    from flowlib.infra.runs import read_metrics
    from flowlib.infra.tracking import Tracker
    tiny_start(tmp_path, monkeypatch)
    cfg = stage3.Stage3Config(
        init_checkpoint="01_shortcut_bc/tiny/best_model.pt", env_id="FastReach-v0", num_envs=16,
        max_episode_steps=40, num_inference_steps=2, rollout_steps=5, total_env_steps=2 * 16 * 5 * 8,
        critic_warmup_steps=0, value_hidden_dims=[16], eval_every=0, num_eval_episodes=2, steer="one_step",
        learner="fql", reward="sparse", fql_offline_steps=30, fql_hidden_dims=[32], replay_batch_size=32,
        replay_size=10_000, replay_updates_per_decision=0.1)
    agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg))
    assert bool(agent.offline_done)
    learner = stage3.make_learner(agent, cfg)
    demos = len(learner.buffer)
    assert demos > 20  # 20 demos of a few chunks each
    run = tmp_path / "03_reinflow" / "fql"
    with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
        stage3.train(cfg, agent, env, run, Tracker(run, resume=False))
    rows = [r for r in read_metrics(run) if "policy_loss" in r]
    assert len(rows) == 2 and all(np.isfinite(r["value_loss"]) and "distill" in r for r in rows)
    saved = torch.load(run / "last.pt", weights_only=False)
    assert saved["replay"]["size"] == demos + 2 * 16 * 5
    assert bool(stage3.load_agent(run / "last.pt").offline_done)


def test_reward_scaling_logs_its_scale_and_a_resumed_run_goes_on_from_the_saved_statistics(tmp_path, monkeypatch):
    """``reward_scaling``: each iteration's row has ``reward_scale``, ``last.pt`` holds the running statistics, and a
    run resumed from it continues them (its count grows from the saved one, not from the prior)."""
    from flowlib.infra.runs import read_metrics
    from flowlib.infra.tracking import Tracker
    tiny_start(tmp_path, monkeypatch)
    run = tmp_path / "03_reinflow" / "scaled"
    counts = []
    for iterations in (2, 3):
        cfg = tiny_chain_config(iterations, reward_scaling=True, reward="dense")
        with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
            agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
            stage3.train(cfg, agent, env, run, Tracker(run, resume=True))
        counts.append(torch.load(run / "last.pt", weights_only=False)["reward_scaler"]["count"])
    assert counts[0] == 1e-4 + 2 * 5 * 16 and counts[1] == counts[0] + 5 * 16
    rows = [r for r in read_metrics(run) if "reward_scale" in r]
    assert len(rows) == 3 and all(0 < r["reward_scale"] < float("inf") for r in rows)


def test_stage2_rollouts_come_from_a_steering_checkpoint_and_a_foreign_one_is_refused_before_a_run(tmp_path,
                                                                                                   monkeypatch):
    """``rollout_checkpoint`` (RFC after steering): a DSRL run's ``last.pt`` collects stage 2's rollouts; each
    recorded chunk is the steered policy's deterministic one on the recorded observations (not stage 1's), and the
    cache keeps them apart from stage 1's.  A missing file, a foreign one and a policy of another task are refused
    by ``flowlib.tools.run``'s preflight with the parameter named; a policy of other dims by the notebook's check."""
    from flowlib.infra.tracking import Tracker
    from flowlib.policies import awsc
    from flowlib.tools import evaluate, run
    tiny_start(tmp_path, monkeypatch)
    cfg = tiny_chain_config(2, steer="latent", actor_lr=1e-2, max_noise_std=1.0, final_noise_std=1.0)
    steering = tmp_path / "06_steering" / "dsrl"
    with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
        agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
        stage3.train(cfg, agent, env, steering, Tracker(steering, resume=False))
    params = {"stage1_checkpoint": "01_shortcut_bc/tiny/best_model.pt", "env_id": "FastReach-v0",
              "rollout_checkpoint": "06_steering/dsrl/last.pt", "rollout_episodes": 4, "rollout_noise_stds": [0.0],
              "max_episode_steps": 40, "num_envs": 4}
    s2 = awsc.AWShortCutConfig(**params)
    assert run.preflight("02_aw_shortcut", params) == ""
    path, stage1_path = awsc.rollout_checkpoint_path(s2), awsc.stage1_checkpoint_path(s2)
    steered, stage1 = evaluate.load_checkpoint_policy(path)[0], bc.load_policy(stage1_path)
    awsc.check_rollout_policy(steered.meta, stage1.meta, path)
    with make_env("FastReach-v0", 4, max_episode_steps=40) as env:
        episodes, rows = awsc.collect_rollouts(steered, env, s2, path)
        base, base_rows = awsc.collect_rollouts(stage1, env, s2, stage1_path)
    assert len(episodes) == 4 and rows[0]["file"] != base_rows[0]["file"]
    ta = steered.act_horizon
    for ep, ep_base in zip(episodes, base):
        assert np.allclose(ep.obs[0], ep_base.obs[0])  # the same env seeds
        window = torch.as_tensor(ep.obs[0]).float()[None, None].expand(1, steered.obs_horizon, -1)  # [1, To, O]
        assert np.allclose(ep.actions[:ta], steered.act(window)[0].numpy(), atol=1e-5)
        assert not np.allclose(ep.actions[:ta], ep_base.actions[:ta], atol=1e-3)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": [1, 2]}, foreign)
    for value, message in (("06_steering/nope/last.pt", "rollout_checkpoint: checkpoint"),
                           (str(foreign), "is not a flowlib policy checkpoint")):
        problem = run.preflight("02_aw_shortcut", {**params, "rollout_checkpoint": value})
        assert problem.startswith("rollout_checkpoint: ") and message in problem, problem
    other_task = awsc.AWShortCutConfig(**{**params, "env_id": "FastPush-v0"})
    assert "env_id = 'FastReach-v0' but this stage 2 needs 'FastPush-v0'" in awsc.rollout_problem(other_task)
    with pytest.raises(ValueError, match="obs_dim"):
        awsc.check_rollout_policy(steered.meta, {**stage1.meta, "obs_dim": stage1.meta["obs_dim"] + 1}, path)
