"""The pipeline on ManiSkill tasks beyond PickCube, by env_id alone (flowlib.envs.tasks): the task table, and for each of
PushCube, StackCube and PegInsertionSide on CPU: motion-planned demos that generate and replay, a reset that carries
nothing over from the episode before, a stage-1 run and a two-iteration stage-3 run of the target recipe."""
import numpy as np
import pytest
import torch

from flowlib.envs import tasks
from flowlib.envs.data import ChunkDataset, demo_path, generate_demos, load_demos
from flowlib.envs.maniskill import control_mode, make_env
from flowlib.envs.smdp import REACH_ENVS
from flowlib.methods import stage3
from flowlib.policies import bc

NEW_TASKS = {"PushCube-v1": (35, 4), "StackCube-v1": (48, 4), "PegInsertionSide-v1": (43, 7)}  # (obs, action) dims


def test_a_task_without_an_entry_gets_the_generic_path():
    assert tasks.task("PokeCube-v1") == tasks.GENERIC and control_mode("PokeCube-v1") == "pd_ee_delta_pos"
    assert not tasks.GENERIC.motion_planning and tasks.GENERIC.stale_at_reset is None
    assert control_mode("PegInsertionSide-v1") == "pd_ee_delta_pose"  # an insertion turns the peg
    assert REACH_ENVS == ("PickCube-v1",)  # the only task whose shaped learning terms are written
    assert set(NEW_TASKS) <= set(tasks.MOTION_PLANNING_ENVS)
    with pytest.raises(ValueError, match="reach_weight reads .* of \\('PickCube-v1',\\) .* set reach_weight: 0.0"):
        stage3.Stage3Config(env_id="StackCube-v1", reward="dense", reach_weight=1.0)


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """Three motion-planned demos of each task, replayed into its control mode (under a temporary outputs root)."""
    root = tmp_path_factory.mktemp("outputs")
    mp = pytest.MonkeyPatch()
    mp.setenv("FLOWLIB_OUTPUTS", str(root))
    yield {env_id: generate_demos(env_id, 3) for env_id in NEW_TASKS}
    mp.undo()


@pytest.mark.sim
@pytest.mark.parametrize("env_id", list(NEW_TASKS))
def test_demos_generate_and_replay_in_the_tasks_control_mode(env_id, demos):
    obs_dim, action_dim = NEW_TASKS[env_id]
    path = demos[env_id]
    assert path.name == f"demos_3.state.{control_mode(env_id)}.physx_cpu.h5"
    episodes = load_demos(path)
    # ManiSkill's replay keeps only the demos whose conversion to the task's control mode still succeeds: for
    # PegInsertionSide's pd_ee_delta_pose 186 of 200 (docs/results/tasks.md), and 2 of these 3 on 2026-12-06's install
    assert 2 <= len(episodes) <= 3 and all(ep.success[-1] for ep in episodes)
    assert all(ep.obs.shape == (len(ep) + 1, obs_dim) and ep.actions.shape == (len(ep), action_dim) for ep in episodes)
    assert all(len(ep) < tasks.task(env_id).episode_steps for ep in episodes)  # the episode length fits the demos
    # the demo's actions from its seed in flowlib's env give the demo's observations (the replay is the env's), but
    # for the joint velocities (dims 9-17 of the Panda's state: the fingers' jitter reaches 0.01 rad/s)
    ep = episodes[0]
    with make_env(env_id, 1, backend="physx_cpu") as env:
        obs = [env.reset(seed=ep.seed)[0]]
        for a in ep.actions[:40]:
            obs.append(env.step(torch.as_tensor(a)[None])[0][0])
    poses = np.r_[0:9, 18:obs_dim]
    assert np.allclose(torch.stack(obs).numpy()[:, poses], ep.obs[:41, poses], atol=1e-3)


@pytest.mark.sim
@pytest.mark.parametrize("env_id", list(NEW_TASKS))
def test_a_reset_after_a_demo_gives_the_observation_of_a_fresh_env(env_id, demos):
    """What PickCube's stale grasp flag needed a fix for (flowlib.envs.tasks' ``stale_at_reset``): here, after an episode
    that solved the task, the next reset's observation is a fresh env's, every dim."""
    assert tasks.task(env_id).stale_at_reset is None
    ep = load_demos(demos[env_id])[1]
    with make_env(env_id, 1, backend="physx_cpu") as env:
        env.reset(seed=ep.seed)
        for a in ep.actions:
            env.step(torch.as_tensor(a)[None])
        after = env.reset(seed=123)[0]
    with make_env(env_id, 1, backend="physx_cpu") as env:
        fresh = env.reset(seed=123)[0]
    assert torch.allclose(after, fresh, atol=1e-6), (after - fresh).abs().argmax()


@pytest.mark.sim
@pytest.mark.parametrize("env_id", list(NEW_TASKS))
def test_stage1_then_two_iterations_of_the_target_recipe_run_on_the_task(env_id, demos, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(demo_path(env_id, 3).parents[2]))
    steps = 20
    cfg = bc.ShortCutBCConfig(env_id=env_id, num_demos=3, velocity_net="unet", down_dims=[8, 16], emb_dim=8, train_steps=4,
                              batch_size=16, warmup_steps=1, ckpt_every=4, eval_every=0, num_eval_episodes=1, num_envs=1,
                              max_episode_steps=steps, eval_inference_steps=[2])
    start = tmp_path / "01_shortcut_bc" / "tiny"
    with make_env(env_id, 1, max_episode_steps=steps, backend="physx_cpu") as env:
        policy, _ = bc.train(cfg, ChunkDataset(load_demos(demos[env_id]), 2, 16), start, env=env)
        assert policy.meta["control_mode"] == control_mode(env_id) and (start / "best_model.pt").is_file()
        per_iter = 2 * 8  # 1 env x 2 chunks x 8 steps
        s3 = stage3.Stage3Config(init_checkpoint=str(start / "best_model.pt"), env_id=env_id, num_envs=1,
                                 max_episode_steps=steps, num_inference_steps=2, steer="residual_step", learner="td3",
                                 reward="dense", residual_gripper=False, residual_bound=0.2,
                                 residual_hidden_dims=[16], value_hidden_dims=[16], rollout_steps=2,
                                 total_env_steps=2 * per_iter, critic_warmup_steps=per_iter, replay_batch_size=8,
                                 eval_every=0, num_eval_episodes=1)
        agent, _ = stage3.build_agent(s3, stage3.init_checkpoint_path(s3), env.spec)
        out = stage3.train(s3, agent, env, tmp_path / "06_steering" / "tiny")
    assert out["env_steps"] == 2 * per_iter and (tmp_path / "06_steering" / "tiny" / "last.pt").is_file()
    loaded = stage3.load_agent(tmp_path / "06_steering" / "tiny" / "last.pt")
    assert loaded.meta["env_id"] == env_id and loaded.action_dim == NEW_TASKS[env_id][1]


SEEDS_METHODS = {  # #73's methods with the settings their params files name, at smoke size
    "rfc": {"steer": "chain", "learner": "rfc", "rfc_mask": "success_only", "rfc_epochs": 1, "update_epochs": 1,
            "minibatch_size": 2},
    "fql": {"steer": "one_step", "learner": "fql", "fql_offline_steps": 3, "fql_hidden_dims": [16],
            "replay_batch_size": 4, "replay_size": 1_000},
    "gaussian": {"steer": "gaussian", "learner": "ppo", "gaussian_bc_steps": 3, "gaussian_hidden_dims": [16],
                 "gaussian_bc_batch": 16, "update_epochs": 1, "minibatch_size": 2},
    "chain_ppo_bc_reg": {"steer": "chain", "learner": "ppo", "bc_coeff": 1.0, "lr_schedule": "cosine",
                         "update_epochs": 1, "minibatch_size": 2},
}


@pytest.mark.sim
@pytest.mark.parametrize("method", list(SEEDS_METHODS))
def test_each_of_the_seeds_methods_runs_two_iterations_on_a_maniskill_task(method, demos, tmp_path, monkeypatch):
    """RFC, FQL (offline on the start's own demos, then online), the Gaussian baseline (cloned from them, then PPO) and
    chain PPO with ReinFlow's W2 pull to the start and a cosine lr, from a stage-1 policy in ManiSkill's PushCube,
    sparse reward: two iterations write their rows and a checkpoint that loads as the method's agent."""
    from flowlib.infra.tracking import Tracker
    env_id = "PushCube-v1"
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(demo_path(env_id, 3).parents[2]))  # where the start's demos are cached
    steps, per_iter = 20, 2 * 8  # 1 env x 2 chunks x 8 steps
    cfg = bc.ShortCutBCConfig(env_id=env_id, num_demos=3, velocity_net="unet", down_dims=[8, 16], emb_dim=8, train_steps=4,
                              batch_size=16, warmup_steps=1, ckpt_every=4, eval_every=0, num_eval_episodes=1, num_envs=1,
                              max_episode_steps=steps, eval_inference_steps=[2])
    start, run = tmp_path / "01_shortcut_bc" / "tiny", tmp_path / "06_steering" / method
    with make_env(env_id, 1, max_episode_steps=steps, backend="physx_cpu") as env:
        bc.train(cfg, ChunkDataset(load_demos(demos[env_id]), 2, 16), start, env=env)
        s3 = stage3.Stage3Config(init_checkpoint=str(start / "best_model.pt"), env_id=env_id, num_envs=1,
                                 max_episode_steps=steps, num_inference_steps=2, reward="sparse", rollout_steps=2,
                                 total_env_steps=2 * per_iter, critic_warmup_steps=0, value_hidden_dims=[16],
                                 eval_every=0, num_eval_episodes=1, **SEEDS_METHODS[method])
        agent, how = stage3.build_agent(s3, stage3.init_checkpoint_path(s3), env.spec)
        assert how == "fresh"
        tracker = Tracker(run, resume=False)
        out = stage3.train(s3, agent, env, run, tracker)
    assert out["env_steps"] == 2 * per_iter and out["iterations"] == 2
    assert len(tracker.rows) == 2 and all(np.isfinite(r["value_loss"]) for r in tracker.rows), tracker.rows
    loaded = stage3.load_agent(run / "last.pt")
    assert type(loaded) is type(agent) and loaded.meta["env_id"] == env_id and loaded.action_dim == 4
    if method == "rfc":
        assert all(0 <= r["reflow_mask_ratio"] <= 1 for r in tracker.rows)
    if method == "fql":
        assert bool(loaded.offline_done)
    if method == "chain_ppo_bc_reg":
        assert all(r["bc_loss"] >= 0 for r in tracker.rows) and tracker.rows[-1]["bc_loss"] > 0
