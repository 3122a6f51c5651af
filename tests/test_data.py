"""Demonstration windows, padding, normalisers and bad demo files (no simulator needed)."""
import json

import h5py
import numpy as np
import pytest
import torch

from flowlib.envs.data import ChunkDataset, Episode, Normalizer, check_held_out, load_demos
from flowlib.envs.tasks import PICKCUBE_GRASPED, PICKCUBE_OBS_DIM


def episode(T: int, obs_dim: int = 3, action_dim: int = 4, offset: float = 0.0) -> Episode:
    """obs[t] = t + offset in every dim; actions[t] = (t, t, t, gripper = -t)."""
    obs = np.repeat(np.arange(T + 1, dtype=np.float32)[:, None] + offset, obs_dim, axis=1)
    actions = np.repeat(np.arange(T, dtype=np.float32)[:, None], action_dim, axis=1)
    actions[:, -1] = -np.arange(T)
    success = np.zeros(T, dtype=bool)
    success[-1] = True
    return Episode(obs, actions, np.linspace(0, 1, T, dtype=np.float32), success, success.copy(), np.zeros(T, dtype=bool))


def test_one_window_per_decision_step():
    ds = ChunkDataset([episode(10), episode(7)], obs_horizon=2, pred_horizon=6)
    assert len(ds) == 10 + 7  # starts -1 .. T-2: every step t = s + 1 at which the policy acts
    obs, act = ds[0]
    assert obs.shape == (2, 3) and act.shape == (6, 4)


def test_padding_at_both_episode_edges():
    ds = ChunkDataset([episode(10)], obs_horizon=2, pred_horizon=6)
    obs, act = ds.window(0, -1)  # first window: one step before the start
    assert obs[:, 0].tolist() == [0, 0]  # first observation repeated
    assert act[:, 0].tolist() == [0, 0, 1, 2, 3, 4]  # first action repeated, then the real ones
    obs, act = ds.window(0, 8)  # last window: runs 4 steps past the end (T = 10)
    assert obs[:, 0].tolist() == [8, 9]
    assert act[:, 0].tolist() == [8, 9, 0, 0, 0, 0]  # delta control: zero displacement after the end ...
    assert act[:, -1].tolist() == [-8, -9, -9, -9, -9, -9]  # ... holding the last gripper command


def test_padding_without_a_gripper_holds_every_dim_still():
    """A task without a gripper (the fast tasks: a 2D displacement) pads every dim with zero after the end; with
    the gripper rule its first dim would be zero and its last kept, a move the demonstrator never made."""
    ds = ChunkDataset([episode(10, action_dim=2)], obs_horizon=2, pred_horizon=6, gripper=False)
    _, act = ds.window(0, 8)
    assert act.tolist() == [[8, -8], [9, -9], [0, 0], [0, 0], [0, 0], [0, 0]]


def test_actions_standardised_on_request():
    eps = [episode(10), episode(5, offset=3.0)]
    obs, act = ChunkDataset(eps, 2, 4, action_norm="meanstd").tensors()
    raw = np.concatenate([e.actions for e in eps])
    assert torch.allclose(ChunkDataset(eps, 2, 4, action_norm="meanstd").action_normalizer.shift, torch.tensor(raw.mean(0)))
    assert act.abs().max() > 1  # not squeezed into [-1, 1]
    with pytest.raises(ValueError, match="normalizer mode must be one of"):
        ChunkDataset(eps, 2, 4, action_norm="minmix")


def test_tensors_match_items_and_are_normalised():
    ds = ChunkDataset([episode(10), episode(5, offset=3.0)], obs_horizon=2, pred_horizon=4)
    obs, act = ds.tensors()
    for i in (0, 7, len(ds) - 1):
        o, a = ds[i]
        assert torch.allclose(obs[i], o) and torch.allclose(act[i], a)
    assert act.min() >= -1 - 1e-6 and act.max() <= 1 + 1e-6


@pytest.mark.parametrize("mode", ["minmax", "meanstd"])
def test_normalizer_round_trip_and_state(mode):
    x = torch.randn(200, 5) * torch.tensor([1.0, 10.0, 0.1, 3.0, 0.0]) + 2.0  # last dim constant
    norm = Normalizer.fit(x, mode)
    y = norm.normalize(x)
    assert torch.allclose(norm.unnormalize(y), x, atol=1e-5)
    assert torch.isfinite(y).all()
    if mode == "minmax":
        assert torch.allclose(y[:, :4].min(0).values, torch.full((4,), -1.0), atol=1e-5)
        assert torch.allclose(y[:, :4].max(0).values, torch.full((4,), 1.0), atol=1e-5)
    else:
        assert torch.allclose(y[:, :4].mean(0), torch.zeros(4), atol=1e-5)
    other = Normalizer(5, "meanstd" if mode == "minmax" else "minmax")
    other.load_state_dict(norm.state_dict())
    assert other.mode == mode and torch.allclose(other.normalize(x), y)
    with pytest.raises(ValueError, match="normalizer mode"):
        Normalizer(3, "zscore")


def write_demo_file(path, control_mode="pd_ee_delta_pos", with_rewards=True, obs=None):
    ep = episode(6)
    with h5py.File(path, "w") as f:
        g = f.create_group("traj_0")
        g["obs"], g["actions"] = ep.obs if obs is None else obs, ep.actions
        g["success"], g["terminated"], g["truncated"] = ep.success, ep.terminated, ep.truncated
        if with_rewards:
            g["rewards"] = ep.rewards
    path.with_suffix(".json").write_text(json.dumps(
        {"env_info": {"env_id": "PickCube-v1", "env_kwargs": {"obs_mode": "state", "control_mode": control_mode}},
         "episodes": [{"episode_id": 0, "episode_seed": 7}]}))
    return path


def test_load_demos_reads_a_maniskill_file(tmp_path):
    eps = load_demos(write_demo_file(tmp_path / "d.h5"))
    assert len(eps) == 1 and eps[0].obs.shape == (7, 3) and eps[0].actions.shape == (6, 4)
    assert eps[0].sparse_rewards.tolist() == [0, 0, 0, 0, 0, 1]
    assert eps[0].seed == 7  # ManiSkill's episode_seed, so evaluations can avoid it


def test_load_demos_clears_the_grasp_that_the_replays_reset_carried_into_a_pickcube_demos_first_observation(tmp_path):
    obs = np.random.default_rng(0).random((7, PICKCUBE_OBS_DIM)).astype(np.float32)
    obs[:, PICKCUBE_GRASPED] = [1, 0, 0, 1, 1, 1, 1]  # the replay's reset says grasped; the cube is held from step 3
    ep = load_demos(write_demo_file(tmp_path / "d.h5", obs=obs))[0]
    assert ep.obs[:, PICKCUBE_GRASPED].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert np.array_equal(np.delete(ep.obs, PICKCUBE_GRASPED, axis=1), np.delete(obs, PICKCUBE_GRASPED, axis=1))


def test_missing_demo_file_says_how_to_get_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="generate_demos"):
        load_demos(tmp_path / "nope.h5")


def test_demo_file_of_another_control_mode_is_rejected_with_the_fix(tmp_path):
    path = write_demo_file(tmp_path / "d.h5", control_mode="pd_joint_pos")
    with pytest.raises(ValueError, match="pd_joint_pos.*replay_trajectory"):
        load_demos(path)


def test_demo_file_without_rewards_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="record-rewards"):
        load_demos(write_demo_file(tmp_path / "d.h5", with_rewards=False))


def test_evaluation_seeds_that_started_training_episodes_are_rejected():
    demos = [Episode(**{**episode(4).__dict__, "seed": s}) for s in (0, 1, 2, 51)]
    check_held_out("eval_seed", 10_000, 50, demos)  # disjoint: fine
    check_held_out("eval_seed", 3, 48, demos)  # seeds 3..50 miss 0, 1, 2 and 51
    with pytest.raises(ValueError, match=r"eval_seed=0 .*memorisation.*eval_seed to a seed >= 52"):
        check_held_out("eval_seed", 0, 50, demos)
    check_held_out("eval_seed", 0, 50, [episode(4)])  # unknown seeds cannot be checked
