"""flowlib.envs.smdp: action chunks as a semi-MDP on real and scripted envs (the discounted chunk reward, an
episode's end inside a chunk, branches from one state, and the rewards learning sees)."""
import math

import pytest
import torch

from flowlib.envs import smdp, tasks
from flowlib.envs.maniskill import make_env
from flowlib.methods import stage3

OBS_DIM, ACT_DIM = tasks.PICKCUBE_OBS_DIM, 4  # PickCube-v1, state obs, pd_ee_delta_pos


@pytest.mark.sim
@pytest.mark.parametrize("num_envs", [1, 2])
def test_an_episode_ending_inside_a_chunk_is_handled_with_one_env_and_with_several(num_envs):
    """One env runs in-process (gymnasium's SyncVectorEnv refuses to step an ended env by default):
    the time limit falls inside the second 8-step chunk, the env idles to the chunk's end, then resets."""
    with make_env("PickCube-v1", num_envs, max_episode_steps=10) as env:
        runner = smdp.ChunkRunner(env, obs_horizon=2, gamma=0.9, reward="dense")
        actions = torch.zeros(num_envs, 8, ACT_DIM)
        first = runner.step_chunk(actions)
        second = runner.step_chunk(actions)
        assert not first["end"].any() and second["end"].all() and not second["terminal"].any()
        assert torch.allclose(second["discount"], torch.full((num_envs,), 0.9 ** 2))  # tau = 2 steps ran
        finished = runner.pop_finished()
        assert [e["length"] for e in finished] == [10] * num_envs
        # the arm held still and grasped nothing: the task flags reached the episode records
        assert all(e["is_robot_static_once"] and not e["is_grasped_once"] for e in finished)
        third = runner.step_chunk(actions)  # the reset envs run on
        assert not third["end"].any()


@pytest.mark.sim
def test_branches_start_from_one_state_and_the_episode_goes_on_with_the_last():
    """Three chunks tried from one state (the first two alike); the 12-step time limit falls inside each.
    Alike branches give alike results, the episode's bookkeeping follows only the last branch, and that
    branch equals a run that never branched (restoring the simulator state is exact to ~1e-4)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.rand(2, 8, ACT_DIM, generator=g) * 2 - 1 for _ in range(2))
    with make_env("PickCube-v1", 2, max_episode_steps=12) as env:
        runner = smdp.ChunkRunner(env, obs_horizon=2, gamma=0.9, reward="dense", first_seed=7)
        runner.step_chunk(torch.zeros(2, 8, ACT_DIM))
        outs = runner.step_branches(torch.stack([a, a, b]))
        window, finished, steps = runner.window.clone(), runner.pop_finished(), runner.env_steps
        plain = smdp.ChunkRunner(env, obs_horizon=2, gamma=0.9, reward="dense", first_seed=7)
        plain.step_chunk(torch.zeros(2, 8, ACT_DIM))
        straight = plain.step_chunk(b)
        again = plain.pop_finished()  # the same two episodes, recorded once
    assert [e["length"] for e in again] == [e["length"] for e in finished] == [12, 12]
    assert [e["return"] for e in again] == pytest.approx([e["return"] for e in finished], abs=1e-3)
    for key in ("reward", "next_window"):
        assert torch.allclose(outs[0][key], outs[1][key], atol=1e-4)
        assert torch.allclose(outs[2][key], straight[key], atol=1e-4)
    assert not torch.allclose(outs[0]["reward"], outs[2]["reward"], atol=1e-3)
    assert all(o["end"].all() and not o["terminal"].any() for o in outs)  # truncated at step 12, each branch
    assert len(finished) == 2 and steps == 2 * 8 + 3 * 2 * 8  # every branch's simulator steps count
    assert torch.allclose(window, plain.window, atol=1e-4)  # reset envs: the next seeds' first windows


@pytest.mark.sim
def test_reward_scale_scales_what_learning_sees_and_not_the_logged_return():
    with make_env("PickCube-v1", 1, max_episode_steps=8) as env:
        out = []
        for scale in (1.0, 0.1):
            runner = smdp.ChunkRunner(env, obs_horizon=2, gamma=0.9, reward="dense", first_seed=5, reward_scale=scale)
            step = runner.step_chunk(torch.zeros(1, 8, ACT_DIM))
            out.append((step["reward"], runner.pop_finished()[0]["return"]))
    (r1, ret1), (r01, ret01) = out
    assert r1.item() > 0 and torch.allclose(r01, 0.1 * r1)
    assert ret1 == pytest.approx(ret01) and ret1 > r1.item()  # undiscounted, unscaled episode return
    with pytest.raises(ValueError, match="reward_scale"):
        stage3.Stage3Config(reward_scale=0.0)


@pytest.mark.sim
def test_shaped_reward_telescopes_to_the_potential_reached():
    """Reward "shaped" adds gamma phi(s') - phi(s) per step with phi_0 = 0: over an 8-step chunk without
    success the discounted sum is gamma^8 phi(s_8), phi = the dense reward of the last step; the logged
    return is the sparse part (0).  Zero actions never succeed."""
    gamma, steps = 0.9, 8
    with make_env("PickCube-v1", 1, max_episode_steps=steps) as env:
        dense = smdp.ChunkRunner(env, obs_horizon=2, gamma=gamma, reward="dense", first_seed=5)
        per_step = [dense.step_chunk(torch.zeros(1, 1, ACT_DIM))["reward"].item() for _ in range(steps)]
        shaped = smdp.ChunkRunner(env, obs_horizon=2, gamma=gamma, reward="shaped", first_seed=5)
        out = shaped.step_chunk(torch.zeros(1, steps, ACT_DIM))
        finished = shaped.pop_finished()
    assert per_step[-1] > 0.01
    assert out["reward"].item() == pytest.approx(gamma ** steps * per_step[-1], rel=1e-4)
    assert out["end"].all() and not out["terminal"].any()
    assert finished[0]["return"] == 0.0 and shaped.phi.item() == 0.0  # reset with the episode
    with pytest.raises(ValueError, match="reward must be one of"):
        stage3.Stage3Config(reward="shaping")


class SolvedFromStep:
    """A scripted env for reward arithmetic: dense reward 0.5 per step, then 1 with success from step
    ``solved_at`` on (ManiSkill's normalized dense pays 1 on success); never terminates, and is truncated
    at step ``limit`` (if given).  Observation after step t: all t."""

    num_envs, device = 1, "cpu"

    def __init__(self, solved_at: int, limit: int = 10**9):
        self.solved_at, self.limit, self.t = solved_at, limit, 0

    def reset(self, seed=None):
        self.t = 0
        return torch.zeros(1, OBS_DIM)

    def step(self, action):
        self.t += 1
        success = torch.tensor([self.t >= self.solved_at])
        reward = torch.where(success, 1.0, 0.5)
        return torch.full((1, OBS_DIM), float(self.t)), reward, torch.zeros(1, dtype=torch.bool), \
            torch.tensor([self.t >= self.limit]), success


def test_success_bonus_adds_to_what_learning_sees_on_solved_steps_only():
    """Six steps solved from the third: learning sees scale * sum_k gamma^k (r_k + B [solved_k]); the
    logged return is the env's (0.5 + 0.5 + 4 x 1)."""
    gamma, scale, bonus = 0.9, 0.1, 4.0
    out = {}
    for b in (0.0, bonus):
        runner = smdp.ChunkRunner(SolvedFromStep(3), obs_horizon=2, gamma=gamma, reward="dense",
                                  reward_scale=scale, success_bonus=b)
        step = runner.step_chunk(torch.zeros(1, 6, ACT_DIM))
        out[b] = (step["reward"].item(), runner.ep_return.item(), bool(runner.ep_success))
    plain = scale * sum(gamma ** k * (1.0 if k >= 2 else 0.5) for k in range(6))
    assert out[0.0][0] == pytest.approx(plain)
    assert out[bonus][0] == pytest.approx(plain + scale * bonus * sum(gamma ** k for k in range(2, 6)))
    assert out[0.0][1:] == out[bonus][1:] == (pytest.approx(5.0), True)
    with pytest.raises(ValueError, match="success_bonus"):
        smdp.ChunkRunner(SolvedFromStep(3), obs_horizon=2, gamma=gamma, reward="sparse", success_bonus=1.0)
    with pytest.raises(ValueError, match="reward 'dense' only"):
        stage3.Stage3Config(reward="shaped", success_bonus=1.0)
    with pytest.raises(ValueError, match="'success_bonus' = -1.0: should be greater"):
        stage3.Stage3Config(reward="dense", success_bonus=-1.0)


class Approach:
    """A scripted PickCube-like env for the reach term: the gripper closes in on the cube, reach(t) =
    1 - tanh(5 d_t) with d_t = 0.1 / t, the normalized dense reward reach / 5 until the grasp at step
    ``grasp_at`` (is_grasped from then on, dense 0.5), and success (dense 1) at step ``solved_at``; the env
    never terminates (``"shaped"`` ends the episode at success itself).  Its observations have PickCube-v1's
    layout with ``tcp_to_obj = [d_t, 0, 0]``, the fingers ``gap(t)`` apart (4 cm: across the cube) and the goal
    ``to_goal(t)`` above the cube (``obj_to_goal = [0, 0, to_goal(t)]``)."""

    num_envs, device = 1, "cpu"

    def __init__(self, grasp_at: int, solved_at: int, flags: bool = True, gap=lambda t: 0.04, to_goal=lambda t: 0.0):
        self.grasp_at, self.solved_at, self.flags, self.gap, self.t = grasp_at, solved_at, flags, gap, 0
        self.to_goal = to_goal
        self.task_flags = {}

    def reach(self, t: int) -> float:
        return 1 - math.tanh(5 * 0.1 / t)

    def reset(self, seed=None):
        self.t = 0
        return torch.zeros(1, tasks.PICKCUBE_OBS_DIM)

    def step(self, action):
        self.t += 1
        grasped, success = self.t >= self.grasp_at, self.t >= self.solved_at
        dense = 1.0 if success else 0.5 if grasped else self.reach(self.t) / 5
        if self.flags:
            self.task_flags = {"is_grasped": torch.tensor([grasped])}
        obs = torch.zeros(1, tasks.PICKCUBE_OBS_DIM)
        obs[0, tasks.PICKCUBE_TCP_TO_OBJ.start] = 0.1 / self.t
        obs[0, tasks.PICKCUBE_FINGERS] = self.gap(self.t) / 2
        obs[0, tasks.PICKCUBE_OBJ_TO_GOAL.start + 2] = self.to_goal(self.t)
        return obs, torch.tensor([dense]), torch.zeros(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool), \
            torch.tensor([success])


def test_reach_weight_adds_the_reach_term_to_the_dense_reward_and_to_the_shaped_potential():
    """Grasp at step 4, success at 6: learning's dense reward gains w reach(s') (reach(s') before the grasp, 1
    from it); the shaped reward's potential phi = r + w reach, 0 at success, so its terms still telescope."""
    gamma, w, env = 0.8, 2.0, Approach(grasp_at=4, solved_at=6)
    reach = [env.reach(t) for t in (1, 2, 3)] + [1.0, 1.0, 1.0]  # after steps 1..6
    dense = [x / 5 for x in reach[:3]] + [0.5, 0.5, 1.0]
    runner = smdp.ChunkRunner(Approach(4, 6), obs_horizon=2, gamma=gamma, reward="dense", reach_weight=w)
    out = runner.step_chunk(torch.zeros(1, 6, ACT_DIM))
    assert out["reward"].item() == pytest.approx(sum(gamma ** k * (dense[k] + w * reach[k]) for k in range(6)))
    assert runner.ep_return.item() == pytest.approx(sum(dense))  # logged: the env's own
    runner = smdp.ChunkRunner(Approach(4, 6), obs_horizon=2, gamma=gamma, reward="shaped", reach_weight=w)
    out = runner.step_chunk(torch.zeros(1, 8, ACT_DIM), auto_reset=False)
    phi = [0.0] + [dense[k] + w * reach[k] for k in range(5)] + [0.0]  # phi(s_0) = 0, phi(success) = 0
    shaped = sum(gamma ** k * ((k == 5) + gamma * phi[k + 1] - phi[k]) for k in range(6))
    assert out["reward"].item() == pytest.approx(shaped) and out["terminal"].item()
    assert shaped == pytest.approx(gamma ** 5)  # the potential telescopes away: the sparse return alone
    with pytest.raises(ValueError, match="is_grasped flag"):
        smdp.ChunkRunner(Approach(4, 6, flags=False), 2, gamma, reward="dense", reach_weight=w).step_chunk(
            torch.zeros(1, 1, ACT_DIM))
    with pytest.raises(ValueError, match="reach_weight applies"):
        smdp.ChunkRunner(Approach(4, 6), 2, gamma, reward="sparse", reach_weight=w)
    with pytest.raises(ValueError, match="reward: dense / shaped"):
        stage3.Stage3Config(reward="sparse", reach_weight=1.0)
    with pytest.raises(ValueError, match="env_id 'PushCube-v1'"):
        stage3.Stage3Config(reward="dense", reach_weight=1.0, env_id="PushCube-v1")
    with pytest.raises(ValueError, match="'reach_weight' = -1.0: should be greater"):
        stage3.Stage3Config(reward="dense", reach_weight=-1.0)


def test_reach_sharpness_steepens_the_added_reach_term_and_leaves_the_dense_rewards_own():
    """Grasp at step 4 with the fingers 1 cm apart until step 5 (a squeeze on the edge), success at 7, the gripper
    10 / t cm from the cube.  With reach_sharpness k the added term is w (1 - tanh(k d)) until the grasp counts,
    1 from it; the dense reward's own reach / 5 (ManiSkill's k = 5), which also pays the squeeze, does not change."""
    gamma, w, k = 0.8, 2.0, 20.0
    gap = lambda t: 0.01 if t in (4, 5) else 0.04
    env = Approach(4, 7, gap=gap)
    held = [env.reach(t) / 5 for t in (1, 2, 3, 4, 5)] + [0.5, 1.0]  # after steps 1..7, the squeeze paid as reach / 5
    steep = [1 - math.tanh(k * 0.1 / t) for t in range(1, 6)] + [1.0, 1.0]
    assert steep[2] < 0.5 < env.reach(3)  # 3.3 cm: 0.42 against ManiSkill's 0.84
    runner = smdp.ChunkRunner(Approach(4, 7, gap=gap), 2, gamma, reward="dense", reach_weight=w,
                              grasp_min_gap=0.035, reach_sharpness=k)
    out = runner.step_chunk(torch.zeros(1, 7, ACT_DIM))
    assert out["reward"].item() == pytest.approx(sum(gamma ** i * (held[i] + w * steep[i]) for i in range(7)))
    default = smdp.ChunkRunner(Approach(4, 7, gap=gap), 2, gamma, reward="dense", reach_weight=w, grasp_min_gap=0.035)
    assert default.step_chunk(torch.zeros(1, 7, ACT_DIM))["reward"].item() > out["reward"].item()  # k = 5 pays more
    with pytest.raises(ValueError, match="'reach_sharpness' = 0.0: should be greater than 0"):
        stage3.Stage3Config(reward="dense", reach_weight=1.0, reach_sharpness=0.0)


def test_grasp_min_gap_pays_a_squeeze_on_the_edge_what_the_approach_pays_and_a_grasp_across_the_cube_in_full():
    """The flag fires at step 3; the fingers are 1 cm apart at steps 3-4 (a squeeze on the cube's edge), 4 cm from
    step 5; success at 7.  With grasp_min_gap 3.5 cm learning sees reach / 5 (+ w reach) at steps 3-4 instead
    of the dense reward's 0.5 (+ w), the full grasp from step 5; the logged return stays the env's."""
    gamma, w, gap = 0.8, 2.0, lambda t: 0.01 if t in (3, 4) else 0.04
    env = Approach(3, 7, gap=gap)
    dense = [env.reach(t) / 5 for t in (1, 2)] + [0.5] * 4 + [1.0]  # after steps 1..7
    held = [env.reach(t) / 5 for t in (1, 2, 3, 4)] + [0.5, 0.5, 1.0]
    reach = [env.reach(t) for t in (1, 2, 3, 4)] + [1.0] * 3
    for w_, expect in ((0.0, held), (w, [h + w * x for h, x in zip(held, reach)])):
        runner = smdp.ChunkRunner(Approach(3, 7, gap=gap), 2, gamma, reward="dense", reach_weight=w_,
                                  grasp_min_gap=0.035)
        out = runner.step_chunk(torch.zeros(1, 7, ACT_DIM))
        assert out["reward"].item() == pytest.approx(sum(gamma ** k * expect[k] for k in range(7)))
        assert runner.ep_return.item() == pytest.approx(sum(dense))  # logged: the env's own
    runner = smdp.ChunkRunner(Approach(3, 7, gap=gap), 2, gamma, reward="dense", reach_weight=w)
    plain = runner.step_chunk(torch.zeros(1, 7, ACT_DIM))["reward"].item()  # grasp_min_gap 0: the flag as is
    assert plain == pytest.approx(sum(gamma ** k * (dense[k] + w * (reach[k] if k < 2 else 1.0)) for k in range(7)))
    runner = smdp.ChunkRunner(Approach(3, 7, gap=gap), 2, gamma, reward="shaped", grasp_min_gap=0.035)
    out = runner.step_chunk(torch.zeros(1, 7, ACT_DIM), auto_reset=False)
    phi = [0.0] + held[:6] + [0.0]
    assert out["reward"].item() == pytest.approx(sum(gamma ** k * ((k == 6) + gamma * phi[k + 1] - phi[k])
                                                     for k in range(7)))
    with pytest.raises(ValueError, match="grasp_min_gap applies"):
        smdp.ChunkRunner(env, 2, gamma, reward="sparse", grasp_min_gap=0.035)
    with pytest.raises(ValueError, match="set grasp_min_gap: 0.0 or reward: dense"):
        stage3.Stage3Config(reward="sparse", grasp_min_gap=0.035)
    with pytest.raises(ValueError, match="finger joints"):
        stage3.Stage3Config(reward="dense", grasp_min_gap=0.035, env_id="PushCube-v1")
    with pytest.raises(ValueError, match="'grasp_min_gap' = -.*: should be greater"):
        stage3.Stage3Config(reward="dense", grasp_min_gap=-0.01)


def test_place_weight_pays_the_steep_place_term_while_the_grasp_counts():
    """The flag fires at step 3 with the fingers 1 cm apart until step 5 (a squeeze on the edge), the cube comes
    down from 8 cm to 1 cm under the goal over steps 1..7, success at 7.  Learning's dense reward gains
    w_p (1 - tanh(k d)) at the steps whose grasp counts (from step 5 with grasp_min_gap 3.5 cm, from step 3 without)
    and at success; the shaped reward's potential gains the same, and its terms still telescope."""
    gamma, w_p, k = 0.8, 2.0, 20.0
    gap, to_goal = (lambda t: 0.01 if t in (3, 4) else 0.04), (lambda t: 0.08 - 0.01 * t)
    env = Approach(3, 7, gap=gap, to_goal=to_goal)
    dense = [env.reach(t) / 5 for t in (1, 2)] + [0.5] * 4 + [1.0]       # the env's, after steps 1..7
    held = [env.reach(t) / 5 for t in (1, 2, 3, 4)] + [0.5, 0.5, 1.0]  # the squeeze paid as the approach
    place = [1 - math.tanh(k * to_goal(t)) for t in range(1, 8)]
    assert place[-1] > 0.8 and place[2] < 0.3  # steep: 1 cm pays 4x what 5 cm does
    for min_gap, learn, counts in ((0.035, held, 4), (0.0, dense, 2)):
        expect = [learn[i] + (w_p * place[i] if i >= counts else 0.0) for i in range(7)]
        runner = smdp.ChunkRunner(Approach(3, 7, gap=gap, to_goal=to_goal), 2, gamma, reward="dense",
                                  grasp_min_gap=min_gap, place_weight=w_p, place_sharpness=k)
        out = runner.step_chunk(torch.zeros(1, 7, ACT_DIM))
        assert out["reward"].item() == pytest.approx(sum(gamma ** i * expect[i] for i in range(7)))
        assert runner.ep_return.item() == pytest.approx(sum(dense))  # logged: the env's own
    runner = smdp.ChunkRunner(Approach(3, 7, gap=gap, to_goal=to_goal), 2, gamma, reward="shaped",
                              grasp_min_gap=0.035, place_weight=w_p, place_sharpness=k)
    out = runner.step_chunk(torch.zeros(1, 7, ACT_DIM), auto_reset=False)
    phi = [0.0] + [held[i] + (w_p * place[i] if i >= 4 else 0.0) for i in range(6)] + [0.0]
    shaped = sum(gamma ** i * ((i == 6) + gamma * phi[i + 1] - phi[i]) for i in range(7))
    assert out["reward"].item() == pytest.approx(shaped) and shaped == pytest.approx(gamma ** 6)
    with pytest.raises(ValueError, match="place_weight applies"):
        smdp.ChunkRunner(env, 2, gamma, reward="sparse", place_weight=w_p)
    with pytest.raises(ValueError, match="set place_weight: 0.0 or reward: dense"):
        stage3.Stage3Config(reward="sparse", place_weight=1.0)
    with pytest.raises(ValueError, match="cube-to-goal offset"):
        stage3.Stage3Config(reward="dense", place_weight=1.0, env_id="PushCube-v1")
    with pytest.raises(ValueError, match="'place_weight' = -1.0: should be greater"):
        stage3.Stage3Config(reward="dense", place_weight=-1.0)
    with pytest.raises(ValueError, match="'place_sharpness' = .*: should be greater than 0"):
        stage3.Stage3Config(reward="dense", place_weight=1.0, place_sharpness=0.0)


class WrongWidth(Approach):
    def step(self, action):
        obs, *rest = super().step(action)
        return obs[:, :40], *rest


def test_grasp_min_gap_on_an_observation_without_pickcubes_layout_is_a_clear_error():
    runner = smdp.ChunkRunner(WrongWidth(3, 7), 2, 0.8, reward="dense", grasp_min_gap=0.035)
    runner.window = runner.window[..., :40]
    with pytest.raises(ValueError, match="state observation \\(42 dims\\), got 40"):
        runner.step_chunk(torch.zeros(1, 1, ACT_DIM))


class TouchThenLeave:
    """A scripted env that is solved at steps 3 and 4 only (the object pushed onto the goal, then past it) and
    truncated at step 8."""

    num_envs, device, task_flags = 1, "cpu", {}

    def reset(self, seed=None):
        self.t = 0
        return torch.zeros(1, 3)

    def reset_some(self, mask, seeds):
        return self.reset()

    def step(self, action):
        self.t += 1
        no = torch.zeros(1, dtype=torch.bool)
        return (torch.full((1, 3), float(self.t)), torch.zeros(1), no, torch.tensor([self.t >= 8]),
                torch.tensor([self.t in (3, 4)]))


def test_terminate_on_success_off_runs_past_a_success_pays_each_solved_step_and_records_success_at_end():
    """Sparse reward: by default the success at step 3 ends the episode (terminal, reward gamma^2); with
    ``terminate_on_success=False`` it runs to the time limit (a truncation, not terminal), earns 1 at each solved
    step (gamma^2 + gamma^3) and its record says it touched the goal but did not end there."""
    gamma = 0.9
    ends = {}
    for terminate in (True, False):
        runner = smdp.ChunkRunner(TouchThenLeave(), obs_horizon=2, gamma=gamma, reward="sparse",
                                  terminate_on_success=terminate)
        step = runner.step_chunk(torch.zeros(1, 8, 2), auto_reset=False)
        ends[terminate] = (step["reward"].item(), bool(step["terminal"]), bool(step["end"]), runner.pop_finished())
    reward, terminal, end, (episode,) = ends[True]
    assert (reward, terminal, end) == (pytest.approx(gamma ** 2), True, True)
    assert (episode["length"], episode["success_once"], episode["success_at_end"]) == (3, True, True)
    reward, terminal, end, (episode,) = ends[False]
    assert (reward, terminal, end) == (pytest.approx(gamma ** 2 + gamma ** 3), False, True)
    assert (episode["length"], episode["success_once"], episode["success_at_end"]) == (8, True, False)
    with pytest.raises(ValueError, match="applies to reward 'sparse'"):
        smdp.ChunkRunner(TouchThenLeave(), obs_horizon=2, gamma=gamma, reward="dense", terminate_on_success=False)
    with pytest.raises(ValueError, match="terminate_on_success: false applies to reward 'sparse'"):
        stage3.Stage3Config(reward="dense", terminate_on_success=False)
    with pytest.raises(ValueError, match="reads success from an episode's termination"):
        stage3.Stage3Config(learner="rfc", rfc_mask="success_only", terminate_on_success=False)
