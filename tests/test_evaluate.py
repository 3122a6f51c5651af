"""python -m flowlib.evaluate: checkpoints of any stage on the same held-out episodes."""
import csv

import pytest
import torch
from test_bc import random_episodes, tiny_cfg

from flowlib.envs.data import ChunkDataset
from flowlib.policies import bc
from flowlib.tools import evaluate


def record_make_env(monkeypatch) -> list[dict]:
    """The keyword arguments of every env ``flowlib.tools.evaluate`` makes, in a list filled as they are made."""
    made, make_env = [], evaluate.make_env
    monkeypatch.setattr(evaluate, "make_env", lambda *a, **kw: made.append(kw) or make_env(*a, **kw))
    return made


@pytest.mark.sim
def test_two_runs_of_one_policy_score_the_same_episodes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    bc.train(tiny_cfg(train_steps=2), ChunkDataset(random_episodes(), 2, 16), tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "best_model.pt").write_bytes((tmp_path / "a" / "best_model.pt").read_bytes())
    made = record_make_env(monkeypatch)
    rc = evaluate.main([str(tmp_path / "a" / "best_model.pt"), str(tmp_path / "b" / "best_model.pt"),
                        "--episodes", "3", "--num-envs", "2", "--max-episode-steps", "10", "--run-name", "t"])
    assert rc == 0
    assert made[0]["fresh_scene"] is not torch.cuda.is_available()  # physx_cpu: a new scene for every episode
    out = tmp_path / "outputs" / "evaluate" / "t"
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["policy"] for r in rows] == ["a/best_model.pt", "b/best_model.pt"]
    assert rows[0]["success"] == rows[1]["success"] and float(rows[1]["diff"]) == 0
    assert (out / "per_episode.csv").read_text().splitlines()[1].startswith("20000,")
    assert float(rows[1]["return_diff"]) == 0 and float(rows[1]["return_diff_se"]) == 0  # same episodes, same returns
    returns = list(csv.DictReader(open(out / "per_episode_return.csv")))
    assert len(returns) == 3
    assert sum(float(r["a/best_model.pt"]) for r in returns) / 3 == pytest.approx(float(rows[0]["return"]))
    assert "a/best_model.pt" in capsys.readouterr().out
    for flag in ("is_grasped", "is_obj_placed", "is_robot_static"):  # PickCube's failure breakdown
        assert rows[0][f"{flag}_once"] == rows[1][f"{flag}_once"]
    flags = list(csv.DictReader(open(out / "per_episode_flags.csv")))
    assert len(flags) == 6 and flags[0]["env_seed"] == "20000" and flags[0]["policy"] == "a/best_model.pt"
    placed = [r["is_obj_placed"] == "True" for r in flags[:3]]
    assert sum(placed) / 3 == pytest.approx(float(rows[0]["is_obj_placed_once"]))


def test_missing_and_foreign_checkpoints_are_named(tmp_path, capsys):
    assert evaluate.main([str(tmp_path / "nope.pt")]) == 2
    assert "nope.pt not found" in capsys.readouterr().err
    torch.save({"weights": 1}, tmp_path / "other.pt")
    assert evaluate.main([str(tmp_path / "other.pt")]) == 2
    assert "not a flowlib flow-policy checkpoint" in capsys.readouterr().err
    (tmp_path / "notes.pt").write_text("# not a checkpoint\n")
    assert evaluate.main([str(tmp_path / "notes.pt")]) == 2
    err = capsys.readouterr().err
    assert "notes.pt is not a readable torch checkpoint" in err and "Traceback" not in err


@pytest.mark.sim
def test_act_horizon_override_re_plans_and_rejects_what_the_chunk_lacks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "outputs"))
    bc.train(tiny_cfg(train_steps=2), ChunkDataset(random_episodes(), 2, 16), tmp_path / "a")
    ckpt = str(tmp_path / "a" / "best_model.pt")
    policy, meta = evaluate.load_checkpoint_policy(ckpt)
    evaluate.set_act_horizon(policy, 3)
    window = torch.zeros(2, meta["obs_horizon"], meta["obs_dim"])
    assert policy.act(window, 2).shape == (2, 3, meta["action_dim"])  # executes 3 actions per chunk
    made = record_make_env(monkeypatch)
    rc = evaluate.main([ckpt, "--act-horizon", "8", "3", "--episodes", "2", "--num-envs", "2",
                        "--max-episode-steps", "10", "--run-name", "ah", "--reuse-scene"])
    assert rc == 0 and made[0]["fresh_scene"] is False
    rows = list(csv.DictReader(open(tmp_path / "outputs" / "evaluate" / "ah" / "results.csv")))
    assert [(r["policy"], r["act_horizon"]) for r in rows] == [("a/best_model.pt@ah8", "8"), ("a/best_model.pt@ah3", "3")]
    assert evaluate.main([ckpt, "--act-horizon", "16"]) == 2  # pred 16 - obs 2 + 1 = 15 actions at most
    assert "act_horizon=16 is outside [1, 15]" in capsys.readouterr().err


def test_labels_take_as_many_parent_folders_as_it_takes_to_tell_checkpoints_apart():
    from pathlib import Path
    paths = [Path("outputs/01_shortcut_bc/push_cube_cpu/best_model.pt"),
             Path("outputs/02_aw_shortcut/push_cube_cpu/seed_0/last.pt"),
             Path("outputs/02_aw_shortcut/push_cube_cpu_demos_control/seed_0/last.pt"),
             Path("outputs/06_steering/run_s0/last.pt")]
    assert list(evaluate.labels(paths).values()) == ["push_cube_cpu/best_model.pt", "push_cube_cpu/seed_0/last.pt",
                                                     "push_cube_cpu_demos_control/seed_0/last.pt", "run_s0/last.pt"]
    assert list(evaluate.labels([Path("a/b/last.pt"), Path("x/a/b/last.pt")]).values()) == ["a/b/last.pt",
                                                                                             "x/a/b/last.pt"]
    assert evaluate.label("run_s0/last.pt", act_horizon=4, noisy=True) == "run_s0/last.pt@ah4@noisy"
    with pytest.raises(ValueError, match="given twice"):
        evaluate.labels([Path("r/last.pt"), Path("r/last.pt")])


def test_zero_x0_hands_every_chunk_the_noise_mode_and_leaves_the_episodes_as_they_were():
    """``zero_x0``: every chunk starts its denoising at x_0 = 0 (DSRL's start), on the same env seeds."""
    from flowlib.envs.maniskill import make_env
    from flowlib.policies.chunk_policy import ChunkPolicy
    from flowlib.policies.policy_eval import evaluate as run_episodes

    class Recorder(ChunkPolicy):
        obs_horizon, pred_horizon, act_horizon = 1, 4, 4

        def __init__(self, action_dim):
            super().__init__()
            self.action_dim, self.x0s, self.first_obs = action_dim, [], []
            self.unused = torch.nn.Parameter(torch.zeros(1))

        def act(self, window, num_steps, generator=None, x0=None):
            self.x0s.append(x0)
            self.first_obs.append(window[:, -1].clone())
            return torch.zeros(window.shape[0], self.act_horizon, self.action_dim)

    with make_env("FastReach-v0", 2, max_episode_steps=8) as env:
        drawn, zero = Recorder(env.spec.action_dim), Recorder(env.spec.action_dim)
        run_episodes(drawn, env, 2, 1, seed=5)
        run_episodes(zero, env, 2, 1, seed=5, zero_x0=True)
    assert all(x.abs().sum() > 0 for x in drawn.x0s) and all(not x.any() for x in zero.x0s)
    assert torch.equal(drawn.first_obs[0], zero.first_obs[0])
