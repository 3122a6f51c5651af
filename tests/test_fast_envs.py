"""The fast torch tasks: dynamics and success against hand-worked cases, seeding independent of num_envs, the
demonstrators' imperfection, demos through the stage-1 data path, and the runner of stage 3 on them."""
import pytest
import torch

from flowlib.envs.data import generate_demos, load_demos
from flowlib.envs.fast_avoid import OBSTACLE_RADIUS, FastAvoid
from flowlib.envs.fast_envs import MAX_STEP, FastPush, FastReach, demonstrate
from flowlib.envs.maniskill import control_mode, make_env
from flowlib.envs.smdp import ChunkRunner


def placed(env, **state):
    """``env`` (one env) reset, then its state set by hand: each value a pair of coordinates."""
    env.reset(seed=0)
    for k, v in state.items():
        env.state[k][0] = torch.tensor(v)
    return env


def test_reach_moves_by_the_clipped_action_stays_in_the_box_and_succeeds_within_the_radius():
    env = placed(FastReach(1), p=(0.0, 0.0), g=(0.5, 0.0))
    obs, reward, term, trunc, success = env.step(torch.tensor([[1.0, 0.0]]))
    assert torch.allclose(env.state["p"][0], torch.tensor([MAX_STEP, 0.0]))
    assert torch.allclose(obs[0], torch.tensor([MAX_STEP, 0.0, 0.5, 0.0, 0.5 - MAX_STEP, 0.0]))
    assert reward.item() == pytest.approx(1 - torch.tanh(torch.tensor(3 * (0.5 - MAX_STEP))).item(), abs=1e-6)
    assert not success.item() and not trunc.item()
    env.step(torch.tensor([[5.0, 0.0]]))  # clipped to a unit action
    assert env.state["p"][0, 0].item() == pytest.approx(2 * MAX_STEP)
    placed(env, p=(0.99, 0.0), g=(0.0, 0.0)).step(torch.tensor([[1.0, 0.0]]))
    assert env.state["p"][0, 0].item() == 1.0  # the box
    placed(env, p=(0.0, 0.0), g=(0.09, 0.0))
    _, reward, term, _, success = env.step(torch.tensor([[1.0, 0.0]]))  # 0.04 from the goal: inside 0.05
    assert success.item() and term.item() and reward.item() == 1.0


def test_a_push_moves_the_disc_out_along_the_contact_normal_only_on_contact():
    env = placed(FastPush(1), p=(-0.3, 0.0), c=(0.0, 0.0), g=(0.5, 0.0))
    env.step(torch.tensor([[1.0, 0.0]]))  # p -0.25: 0.25 from the disc's centre, contact is at 0.15
    assert torch.equal(env.state["c"][0], torch.tensor([0.0, 0.0])) and not env.task_flags["is_contact"].item()
    env.step(torch.tensor([[1.0, 0.0]])), env.step(torch.tensor([[1.0, 0.0]]))  # p -0.15: touching, not overlapping
    assert torch.equal(env.state["c"][0], torch.tensor([0.0, 0.0]))
    env.step(torch.tensor([[1.0, 0.0]]))  # p -0.1: the disc goes to p + 0.15 along +x
    assert torch.allclose(env.state["c"][0], torch.tensor([0.05, 0.0]), atol=1e-6) and env.task_flags["is_contact"].item()
    placed(env, p=(-0.1, -0.1), c=(0.0, 0.0), g=(0.5, 0.5))  # an oblique push: out along the diagonal
    env.step(torch.tensor([[0.0, 0.0]]))
    assert torch.allclose(env.state["c"][0], torch.full((2,), -0.1 + 0.15 / 2 ** 0.5), atol=1e-6)


def test_a_push_across_the_disc_drags_it_by_the_friction_share_of_the_sideways_motion():
    env = placed(FastPush(1), p=(-0.12, 0.0), c=(0.0, 0.0), g=(0.5, 0.5))
    env.step(torch.tensor([[1.0, 1.0]]))  # p -> (-0.07, 0.05), inside the contact distance 0.15
    p = torch.tensor([-0.07, 0.05])
    n = (torch.zeros(2) - p) / (torch.zeros(2) - p).norm()
    d = torch.tensor([0.05, 0.05])
    expected = p + 0.15 * n + 0.8 * (d - (d @ n) * n)  # the docstring's c' = p' + (r_p + r_o) n + mu (d - (d.n) n)
    assert torch.allclose(env.state["c"][0], expected, atol=1e-6)
    assert (env.state["c"][0] - p).norm().item() > 0.15  # the disc ends clear of the pusher


def test_push_success_needs_the_disc_within_three_centimetres_of_the_goal():
    env = placed(FastPush(1), p=(-0.9, -0.9), c=(0.0, 0.0), g=(0.035, 0.0))
    _, reward, _, _, success = env.step(torch.zeros(1, 2))
    assert not success.item() and reward.item() < 1 and env.task_flags["is_obj_near"].item()
    placed(env, p=(-0.9, -0.9), c=(0.0, 0.0), g=(0.025, 0.0))
    assert env.step(torch.zeros(1, 2))[4].item()


@pytest.mark.parametrize("task", [FastReach, FastPush, FastAvoid])
def test_an_episode_depends_on_its_seed_alone_not_on_num_envs_or_a_partial_reset(task):
    many, one = task(4), task(1)
    obs = many.reset(seed=100)
    assert torch.equal(obs[2], one.reset(seed=102)[0])
    again = many.reset_some(torch.tensor([False, True, False, False]), [0, 102, 0, 0])
    assert torch.equal(again[1], obs[2])
    actions = torch.rand(4, 2) * 2 - 1
    assert torch.equal(many.demo_params[2], one.demo_params[0])  # the demonstrator's per-episode errors too
    states = many.snapshot()
    first = many.step(actions)[0]
    many.restore(states)
    assert torch.equal(many.step(actions)[0], first)


# the push demonstrator is set higher (0.76 of its 1,000 demos): its clone loses ~half of that (docs/fast_tasks.md)
@pytest.mark.parametrize("task, low, high", [("FastReach-v0", 0.5, 0.8), ("FastPush-v0", 0.6, 0.9),
                                             ("FastAvoid-v0", 0.7, 0.9)])
def test_the_demonstrator_is_imperfect_in_the_intended_band(task, low, high):
    env = make_env(task, 400)
    env.reset(seed=0)
    gen, once = torch.Generator().manual_seed(0), torch.zeros(400, dtype=torch.bool)
    for _ in range(env.max_episode_steps):
        once |= env.step(demonstrate(env, gen))[4]
    assert low <= once.float().mean().item() <= high


def test_scripted_demos_go_through_stage_1s_data_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    path = generate_demos("FastPush-v0", 12)
    assert path.name == "demos_12.state.ee_delta_pos.torch.h5" and generate_demos("FastPush-v0", 12) == path
    episodes = load_demos(path)
    assert len(episodes) == 12 and episodes[0].obs.shape == (81, 10) and episodes[0].actions.shape == (80, 2)
    assert [e.seed for e in episodes] == list(range(12))
    assert any(not e.success.any() for e in episodes)  # failures are kept: the imperfection is the point
    with pytest.raises(ValueError, match="recorded with control_mode='ee_delta_pos', this pipeline needs"):
        load_demos(path, control_mode="pd_ee_delta_pos")
    assert control_mode("FastPush-v0") == "ee_delta_pos" and control_mode("PickCube-v1") == "pd_ee_delta_pos"


def test_make_env_maps_maniskills_backend_names_and_refuses_what_a_fast_task_lacks():
    assert make_env("FastReach-v0", 2, backend="physx_cpu").backend == "torch_cpu"
    with pytest.raises(ValueError, match="obs_mode 'state', control_mode 'ee_delta_pos'"):
        make_env("FastReach-v0", 2, obs_mode="rgb")
    env = make_env("FastReach-v0", 2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"action must be \[2, 2\]"):
        env.step(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="NaN or inf"):
        env.step(torch.full((2, 2), float("nan")))
    assert env.render(size=32).shape == (2, 32, 32, 3)


def test_the_chunk_runner_of_stage_3_steps_a_fast_task_with_auto_reset():
    env = make_env("FastReach-v0", 3, max_episode_steps=4)
    runner = ChunkRunner(env, obs_horizon=2, gamma=0.9, reward="sparse", first_seed=50)
    out = runner.step_chunk(torch.zeros(3, 4, 2))  # the time limit ends every episode inside the chunk
    assert out["end"].all() and not out["terminal"].any() and out["next_window"].shape == (3, 2, 6)
    assert len(runner.pop_finished()) == 3 and runner.next_seed == 56


# --------------------------------------------------------------------------- FastAvoid: two modes, and their mean collides


def run(env, policy, steps=None):
    """Each episode's success and flags (ever true) under ``policy(env) -> actions [N, 2]``."""
    once = {k: torch.zeros(env.num_envs, dtype=torch.bool) for k in ("success", "is_hit", "is_left", "is_right")}
    for _ in range(steps or env.max_episode_steps):
        once["success"] |= env.step(policy(env))[4]
        for k in ("is_hit", "is_left", "is_right"):
            once[k] |= env.task_flags[k]
    return once


def test_the_avoid_demonstrator_takes_both_sides_in_its_share_and_the_straight_mean_path_collides():
    env = make_env("FastAvoid-v0", 2000)
    env.reset(seed=0)
    gen = torch.Generator().manual_seed(0)
    demos = run(env, lambda e: demonstrate(e, gen))
    assert 0.45 <= demos["is_left"].float().mean() <= 0.55 and 0.45 <= demos["is_right"].float().mean() <= 0.55
    assert not (demos["is_left"] & demos["is_right"]).any()  # one side per episode
    env.reset(seed=0)
    def straight(e):  # the two modes' mean: no detour
        return 0.6 * (e.state["g"] - e.state["p"]) / (e.state["g"] - e.state["p"]).norm(dim=-1, keepdim=True)

    straight = run(env, straight)
    assert straight["is_hit"].all() and not straight["success"].any()


def test_a_collision_stops_the_point_on_the_surface_and_fails_the_episode_even_at_the_goal():
    env = placed(FastAvoid(1), p=(-0.4, 0.0), g=(0.4, 0.0), o=(0.0, 0.0))
    env.step(torch.tensor([[1.0, 0.0]]))                                   # to x = -0.35: clear of the disc
    assert not env.task_flags["is_hit"][0]
    for _ in range(3):
        env.step(torch.tensor([[1.0, 0.0]]))
    assert env.task_flags["is_hit"][0] and torch.allclose(env.state["p"][0].norm(), torch.tensor(OBSTACLE_RADIUS))
    env.state["p"][0] = torch.tensor([0.39, 0.0])                           # at the goal, after the collision
    assert not env.step(torch.zeros(1, 2))[4][0]


def test_the_mode_flags_say_which_side_a_hand_made_path_passed_on():
    env = make_env("FastAvoid-v0", 2)
    env.reset(seed=0)
    for k, v in {"p": (-0.5, 0.0), "g": (0.5, 0.0), "o": (0.0, 0.0)}.items():
        env.state[k][:] = torch.tensor(v)
    waypoints = torch.tensor([[[-0.1, 0.4], [0.1, 0.4], [0.5, 0.0]], [[-0.1, -0.4], [0.1, -0.4], [0.5, 0.0]]])

    def follow(e):  # each env to its next waypoint at full speed
        k = (e.state["p"][:, 0:1] > waypoints[:, :, 0] - 0.01).sum(1).clamp(max=2)
        target = waypoints[torch.arange(2), k]
        return ((target - e.state["p"]) / MAX_STEP).clamp(-1, 1)

    flags = run(env, follow, steps=40)
    assert flags["is_left"].tolist() == [True, False] and flags["is_right"].tolist() == [False, True]
    assert not flags["is_hit"].any() and flags["success"].all()
