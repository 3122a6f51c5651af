"""The Meta-World backend (flowlib.envs.metaworld_envs): seeding independent of num_envs and of what ran before, held-out
positions, the success flag, a reset after a solved episode, truncation kept apart from termination in the chunk
runner, expert demos through the stage-1 data path, bad names, and stage 1 then two iterations of chain PPO."""
import numpy as np
import pytest
import torch

pytest.importorskip("metaworld", reason="the metaworld extra (make install installs it)")

from flowlib.envs import metaworld_envs
from flowlib.envs.data import ChunkDataset, demo_path, generate_demos, load_demos  # noqa: E402
from flowlib.envs.maniskill import check_env_id, control_mode, make_env  # noqa: E402
from flowlib.envs.smdp import ChunkRunner  # noqa: E402
from flowlib.envs.tasks import task  # noqa: E402
from flowlib.methods import stage3
from flowlib.policies import bc  # noqa: E402
from flowlib.tools import evaluate

pytestmark = pytest.mark.sim  # every test here steps MuJoCo or runs the scripted experts

TASK = "pick-place-v3"  # the expert solves it in ~50 steps
GOAL, OBJ = slice(36, 39), slice(4, 7)
POSITIONS = [*range(4, 7), *range(36, 39)]  # the object and the goal


def expert_actions(env, obs: torch.Tensor) -> torch.Tensor:
    """The scripted expert's actions for every env's observation ``obs [N, 39]``."""
    policy = metaworld_envs.expert(env.spec.env_id)
    return torch.as_tensor(np.stack([policy.get_action(o.double().numpy()) for o in obs]), dtype=torch.float32)


def rollout(env, seed, actions: torch.Tensor) -> torch.Tensor:
    """Observations ``[T + 1, N, 39]`` of episodes from ``seed`` under ``actions [T, N, 4]``."""
    obs = [env.reset(seed=seed)]
    return torch.stack(obs + [env.step(a)[0] for a in actions])


def test_an_episode_depends_on_its_seed_alone_not_on_num_envs_or_what_ran_before():
    actions = torch.rand(25, 3, 4, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with make_env(TASK, 1) as one, make_env(TASK, 3) as three:
        alone = rollout(one, 7, actions[:, :1])
        for _ in range(30):  # run another episode in between: the next one must not remember it
            one.step(torch.ones(1, 4))
        again = rollout(one, 7, actions[:, :1])
        batched = rollout(three, 5, actions[:, [1, 2, 0]])  # env 2 gets seed 7 and env 0's actions
        listed = three.reset(seed=[7, 0, 1])
    assert torch.equal(alone, again) and torch.equal(alone[:, 0], batched[:, 2]) and torch.equal(alone[0, 0], listed[0])
    assert not torch.equal(batched[0, 0, GOAL], batched[0, 1, GOAL])  # another seed, another goal


def test_held_out_seeds_give_object_and_goal_positions_no_demo_and_no_training_episode_used():
    """Positions are drawn afresh per seed from the task's continuous reset box (not Meta-World's 50 fixed ones): the
    evaluation seeds' differ from those of the demos (0 on) and of training (2,000,000 on)."""
    with make_env(TASK, 1) as env:
        def positions(seeds):
            return torch.stack([env.reset(seed=s)[0, POSITIONS] for s in seeds])  # [S, 6]
        used = positions([*range(20), *range(2_000_000, 2_000_020)])
        held_out = positions([*range(20_000, 20_020), *range(30_000, 30_020)])
    distance = torch.cdist(held_out, used).min()
    assert distance > 1e-3, distance
    assert len({tuple(p.tolist()) for p in held_out}) == len(held_out)


def test_the_expert_succeeds_and_a_reset_after_the_solved_episode_gives_a_fresh_observation():
    with make_env(TASK, 1) as env:
        first = env.reset(seed=3)
        obs, solved_at = first, None
        for t in range(task(TASK).episode_steps):
            obs, reward, terminated, truncated, success = env.step(expert_actions(env, obs))
            assert not terminated.item()  # Meta-World never terminates; success is reported beside
            if success.item():
                solved_at = t
                break
        assert solved_at is not None and solved_at < 100
        assert 0.5 < reward.item() <= 1.0  # normalized_dense: Meta-World's reward / 10, high at the goal
        assert set(env.task_flags) == {"grasp_success", "near_object"} and env.task_flags["near_object"].item()
        fresh = env.reset(seed=3)
    assert torch.equal(fresh, first)  # the object back on the table, the hand at home


def test_truncation_is_kept_apart_from_termination_in_the_chunk_runner():
    """Sparse reward: a success ends its decision as terminal (no bootstrap); a time-out ends it without."""
    steps = 12  # too short for the expert, long enough for one chunk past it
    with make_env(TASK, 2, max_episode_steps=steps) as env:
        runner = ChunkRunner(env, obs_horizon=1, gamma=0.9, reward="sparse", first_seed=0)
        out = [runner.step_chunk(torch.zeros(2, 8, 4)) for _ in range(2)]
    assert not out[0]["end"].any() and out[1]["end"].all() and not out[1]["terminal"].any()
    assert torch.allclose(out[1]["discount"], torch.full((2,), 0.9 ** 4))  # the episode ran 4 of the chunk's 8
    finished = runner.pop_finished()
    assert len(finished) == 2 and all(f["length"] == steps and not f["success_once"] for f in finished)
    with make_env(TASK, 1) as env:
        runner = ChunkRunner(env, obs_horizon=1, gamma=0.9, reward="sparse", first_seed=3)
        for _ in range(20):
            obs = runner.window[:, -1]
            out = runner.step_chunk(expert_actions(env, obs)[:, None].repeat(1, 4, 1))  # hold the expert's action
            if out["end"].any():
                break
    assert out["terminal"].all() and out["reward"].item() > 0 and runner.pop_finished()[0]["success_once"]


def test_expert_demos_generate_save_and_load_with_their_seeds_and_noise(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    path = generate_demos(TASK, 3)
    assert path == demo_path(TASK, 3) and "noise" in path.name and generate_demos(TASK, 3) == path  # cached
    episodes = load_demos(path)
    assert [e.seed for e in episodes] == [0, 1, 2]
    for e in episodes:
        assert e.obs.shape == (len(e) + 1, 39) and e.actions.shape == (len(e), 4)
        assert e.success[-1] and e.terminated[-1] and not e.success[:-1].any()  # ended at the first success
    noisy = metaworld_envs.expert_episodes(TASK, [0, 1], action_noise=0.5, max_episode_steps=40)
    again = metaworld_envs.expert_episodes(TASK, [1], action_noise=0.5, max_episode_steps=40)
    assert np.array_equal(noisy[1]["actions"], again[0]["actions"])  # seeded per episode, not per set
    assert not np.allclose(noisy[0]["actions"], episodes[0].actions[:len(noisy[0]["actions"])])
    assert len(noisy[0]["actions"]) == 40 and noisy[0]["truncated"][-1] != noisy[0]["success"][-1]
    dataset = ChunkDataset(episodes, 2, 16)
    assert dataset.obs_dim == 39 and dataset.action_dim == 4 and control_mode(TASK) == "mocap_delta_pos"


def test_bad_names_and_settings_get_one_clear_line():
    with pytest.raises(ValueError, match=r"unknown Meta-World task 'pick-plce-v3'; did you mean \['pick-place-v3'"):
        check_env_id("pick-plce-v3")
    with pytest.raises(ValueError, match="obs_mode 'state'"):
        make_env(TASK, 1, obs_mode="rgb")
    with pytest.raises(ValueError, match="MuJoCo on the CPU"):
        make_env(TASK, 1, backend="physx_cuda")


def test_a_missing_extra_is_named_with_the_install_command(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_metaworld(name, *args, **kwargs):
        if name.startswith("metaworld"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_metaworld)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[metaworld\]'"):
        check_env_id(TASK)


def test_stage_one_then_two_iterations_of_chain_ppo_on_a_metaworld_task(tmp_path, monkeypatch):
    from flowlib.infra.tracking import Tracker
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    steps, per_iter = 16, 2 * 2 * 8  # 2 envs x 2 chunks x 8 steps
    cfg = bc.ShortCutBCConfig(env_id=TASK, num_demos=3, velocity_net="mlp", mlp_dims=[32, 32], emb_dim=8,
                              train_steps=30, batch_size=32, warmup_steps=1, ckpt_every=30, eval_every=0,
                              num_eval_episodes=2, num_envs=2, max_episode_steps=steps, eval_inference_steps=[2])
    start, run = tmp_path / "01_shortcut_bc" / "tiny", tmp_path / "03_reinflow" / "tiny"
    dataset, _ = bc.demo_dataset(cfg)
    with make_env(TASK, 2, max_episode_steps=steps) as env:
        policy, _ = bc.train(cfg, dataset, start, env=env)
        scored = bc.evaluate(policy, env, 2, 2, seed=20_000)
        assert 0 <= scored["success_once"] <= 1
        s3 = stage3.Stage3Config(init_checkpoint=str(start / "best_model.pt"), env_id=TASK, num_envs=2,
                                 max_episode_steps=steps, num_inference_steps=2, reward="sparse", rollout_steps=2,
                                 total_env_steps=2 * per_iter, critic_warmup_steps=0, value_hidden_dims=[16],
                                 update_epochs=1, minibatch_size=4, eval_every=0, num_eval_episodes=1)
        agent, how = stage3.build_agent(s3, stage3.init_checkpoint_path(s3), env.spec)
        tracker = Tracker(run, resume=False)
        out = stage3.train(s3, agent, env, run, tracker)
    assert how == "fresh" and out["env_steps"] == 2 * per_iter and out["iterations"] == 2
    assert len(tracker.rows) == 2 and all(np.isfinite(r["policy_loss"]) for r in tracker.rows), tracker.rows
    loaded = stage3.load_agent(run / "last.pt")
    assert loaded.meta["env_id"] == TASK and loaded.meta["control_mode"] == "mocap_delta_pos"
    # the paired evaluation at several step counts: the stage-1 ODE and the fine-tuned chain at K = 1 and 2
    results = evaluate.evaluate_checkpoints([start / "best_model.pt", run / "last.pt"], 2, 2, 30_000, 4,
                                            max_episode_steps=steps, steps=[1, 2])
    assert list(results) == ["tiny/best_model.pt@K1", "tiny/best_model.pt@K2", "tiny/last.pt@K1", "tiny/last.pt@K2"]
    assert all(len(r["per_episode_success_once"]) == 2 for r in results.values())


def test_a_worker_that_fails_raises_its_traceback_in_the_parent():
    import functools

    from flowlib.envs.vector import EnvGroups
    make = functools.partial(metaworld_envs.MetaWorldGroup, env_id="pick-plce-v3", max_episode_steps=10,
                             reward_mode="sparse", render=False, camera_size=32)
    with pytest.raises(RuntimeError, match="an env worker failed:(.|\n)*unknown Meta-World task 'pick-plce-v3'"):
        EnvGroups(make, 2, 1)


def test_frames_render_from_a_worker_process():
    """Notebook 01's rollout picture: MuJoCo's OSMesa backend (libosmesa6, make system-deps) in a worker."""
    with make_env(TASK, 1, render=True, camera_size=32) as env:
        env.reset(seed=0)
        frames = env.render()
    assert frames.shape == (1, 32, 32, 3) and frames.dtype == np.uint8 and frames.std() > 0
