"""Chain ReinFlow learns: on the fast reach task, a short seeded run of PPO through the denoising chain lifts a
cloned policy by a margin many standard errors wide, and the same run on flipped advantages makes it worse.

The whole pipeline at small size: scripted demos, ShortCut BC with an MLP velocity net, then stage 3 through
``flowlib.stage3`` (``params/03_reinflow/fast_reach.yaml``'s batch of 2,560 decisions, ``fast_reach_mlp.yaml``'s learning rate), each policy scored on the
same held-out episodes."""
import numpy as np

from flowlib import bc, stage3
from flowlib.data import ChunkDataset, generate_demos, load_demos
from flowlib.envs import make_env

EPISODES = 512


def test_chain_ppo_lifts_a_cloned_policy_and_the_flipped_control_lowers_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    dataset = ChunkDataset(load_demos(generate_demos("FastReach-v0", 500)), 2, 16)
    bc_cfg = bc.ShortCutBCConfig(env_id="FastReach-v0", velocity_net="mlp", mlp_dims=[256, 256], emb_dim=16,
                                 train_steps=1200, batch_size=256, warmup_steps=50, ckpt_every=1200, num_envs=256,
                                 max_episode_steps=40)
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


def test_reward_scaling_logs_its_scale_and_a_resumed_run_goes_on_from_the_saved_statistics(tmp_path, monkeypatch):
    """``reward_scaling``: each iteration's row has ``reward_scale``, ``last.pt`` holds the running statistics, and a
    run resumed from it continues them (its count grows from the saved one, not from the prior)."""
    import torch

    from flowlib.runs import read_metrics
    from flowlib.tracking import Tracker
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    dataset = ChunkDataset(load_demos(generate_demos("FastReach-v0", 20)), 2, 16)
    bc_cfg = bc.ShortCutBCConfig(env_id="FastReach-v0", velocity_net="mlp", mlp_dims=[32, 32], emb_dim=8,
                                 train_steps=20, batch_size=32, warmup_steps=2, ckpt_every=20, eval_every=0,
                                 num_eval_episodes=2, num_envs=2, max_episode_steps=40)
    bc.train(bc_cfg, dataset, tmp_path / "01_shortcut_bc" / "tiny")
    run = tmp_path / "03_reinflow" / "scaled"
    counts = []
    for iterations in (2, 3):
        cfg = stage3.Stage3Config(
            init_checkpoint="01_shortcut_bc/tiny/best_model.pt", env_id="FastReach-v0", num_envs=16,
            max_episode_steps=40, num_inference_steps=2, rollout_steps=5, total_env_steps=iterations * 16 * 5 * 8,
            update_epochs=1, minibatch_size=40, critic_warmup_steps=0, value_hidden_dims=[16], eval_every=0,
            num_eval_episodes=2, reward_scaling=True, reward="dense")
        with make_env("FastReach-v0", 16, max_episode_steps=40) as env:
            agent, _ = stage3.build_agent(cfg, stage3.init_checkpoint_path(cfg), env.spec)
            stage3.train(cfg, agent, env, run, Tracker(run, resume=True))
        counts.append(torch.load(run / "last.pt", weights_only=False)["reward_scaler"]["count"])
    assert counts[0] == 1e-4 + 2 * 5 * 16 and counts[1] == counts[0] + 5 * 16
    rows = [r for r in read_metrics(run) if "reward_scale" in r]
    assert len(rows) == 3 and all(0 < r["reward_scale"] < float("inf") for r in rows)
