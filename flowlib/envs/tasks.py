"""What is particular to each ManiSkill task, in one place: ``TASKS[env_id]``; any other id gets ``GENERIC``.

Stages 1-3, ``flowlib.tools.evaluate`` and ``flowlib.tools.seeds`` take a task by ``env_id`` alone.  What differs between tasks:

* ``control_mode``: what the motion-planned demos are replayed into and what the policy commands.  The position-only
  ``pd_ee_delta_pos`` (dx, dy, dz, gripper) serves the tasks a top-down gripper solves; an insertion needs the
  end effector's orientation too, ``pd_ee_delta_pose`` (dx, dy, dz, droll, dpitch, dyaw, gripper), as ManiSkill's
  own diffusion-policy baseline replays PegInsertionSide (``examples/baselines/diffusion_policy/examples.sh``).
* ``episode_steps``: the episode length of evaluation and training (``max_episode_steps`` overrides it).  ManiSkill
  registers short ones, tuned for RL from scratch; its imitation baselines run motion-planned demos' tasks longer
  (100 steps; 300 for the insertion).
* ``motion_planning``: ManiSkill ships a motion-planning solution, so ``flowlib.envs.data.generate_demos`` makes demos.
* ``stale_at_reset``: ``(state width, dim)`` of an observation entry that a ``physx_cpu`` reset fills from the
  previous episode, whose true value at a reset is 0 (``flowlib.envs.maniskill.clear_grasp_at_reset``).  Only PickCube-v1 has
  one: its ``is_grasped`` is read off the last physics step's contacts.  The other tasks here put no
  contact-derived entry in their state observation (checked against ManiSkill's ``_get_obs_extra``, and by
  ``tests/test_tasks.py``: a reset after an episode gives the observation of a fresh env).
* ``shaped_terms``: the learning reward's reach / grasp-gap / place terms (``flowlib.envs.smdp.ChunkRunner``) read this
  task's observation layout; only PickCube-v1's is written.  Elsewhere the learning reward is ManiSkill's own
  (``dense`` = its normalised dense reward, ``sparse`` = success) and those terms are refused.

The evaluation flags an episode is broken down by (``flowlib.tools.evaluate``) need no entry: they are every true/false
entry of the task's own ``evaluate()`` (PickCube: ``is_grasped``, ``is_obj_placed``, ``is_robot_static``; StackCube:
``is_cubeA_grasped``, ``is_cubeA_on_cubeB``, ``is_cubeA_static``).  Adding a task: a params file, plus an entry here
when one of the fields above differs from ``GENERIC`` (docs/howto/new_task.md).

Meta-World tasks (``flowlib.envs.metaworld_envs``) go by their v3 names (``pick-place-v3``) and act in
``mocap_delta_pos``.  Their entries say two things more: ``episode_steps``, cut from Meta-World's 500 to about twice
the steps its scripted expert takes at most (so a failed episode costs less of a CPU budget; measured on 10 seeds:
pick-place 59, push 71, assembly 96, shelf-place 119, disassemble 179, stick-pull 172, peg-insert-side 249), and
``demo_noise``, the std of the Gaussian noise added to each of the expert's actions in the task's demos
(``flowlib.envs.data.generate_demos``): the documented, seeded imperfection that leaves RL room.  A v3 name without an
entry gets ``METAWORLD_GENERIC``: Meta-World's 500 steps, noise 0.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_CONTROL_MODE = "pd_ee_delta_pos"
METAWORLD_CONTROL_MODE = "mocap_delta_pos"  # the hand's mocap target moves by action[:3] / 100 m; action[3] grips
METAWORLD_NAME = re.compile(r"[a-z][a-z0-9-]*-v3")  # Meta-World v3's task names: pick-place-v3, assembly-v3, ...


@dataclass(frozen=True)
class Task:
    """One task's particulars (module docstring)."""

    control_mode: str = DEFAULT_CONTROL_MODE
    episode_steps: int = 100
    motion_planning: bool = False
    stale_at_reset: tuple[int, int] | None = None  # (state obs width, dim) a physx_cpu reset leaves from before
    shaped_terms: bool = False  # the reach / grasp-gap / place learning terms read its observation
    demo_noise: float = 0.0  # Meta-World: std of the Gaussian noise on each expert action of the task's demos


GENERIC = Task()
METAWORLD_GENERIC = Task(control_mode=METAWORLD_CONTROL_MODE, episode_steps=500)


def _metaworld(episode_steps: int, demo_noise: float = 0.0) -> Task:
    return Task(control_mode=METAWORLD_CONTROL_MODE, episode_steps=episode_steps, demo_noise=demo_noise)


# PickCube-v1's state observation, 42 dims (mani_skill 3.0.x, PickCubeEnv._get_obs_extra): qpos 9 (the two finger
# joints last, m each), qvel 9, is_grasped 1, tcp_pose 7, goal_pos 3, obj_pose 7, tcp_to_obj_pos 3, obj_to_goal_pos 3
PICKCUBE_OBS_DIM = 42
PICKCUBE_FINGERS, PICKCUBE_GRASPED = slice(7, 9), 18
PICKCUBE_TCP, PICKCUBE_GOAL, PICKCUBE_OBJ = slice(19, 22), slice(26, 29), slice(29, 32)  # positions
PICKCUBE_TCP_TO_OBJ, PICKCUBE_OBJ_TO_GOAL = slice(36, 39), slice(39, 42)  # cube - gripper centre, goal - cube

TASKS = {
    # is_grasped at a reset: 149 of 150 replayed demos start "grasped" on physx_cpu when the previous episode ended
    # holding the cube; every episode starts with the gripper open above a cube on the table, so the truth is 0
    "PickCube-v1": Task(episode_steps=100, motion_planning=True, stale_at_reset=(PICKCUBE_OBS_DIM, PICKCUBE_GRASPED),
                        shaped_terms=True),
    "PushCube-v1": Task(episode_steps=100, motion_planning=True),
    "PullCube-v1": Task(episode_steps=100, motion_planning=True),
    "StackCube-v1": Task(episode_steps=200, motion_planning=True),
    "LiftPegUpright-v1": Task(episode_steps=100, motion_planning=True),
    "PegInsertionSide-v1": Task(control_mode="pd_ee_delta_pose", episode_steps=300, motion_planning=True),
    "PlugCharger-v1": Task(control_mode="pd_ee_delta_pose", episode_steps=300, motion_planning=True),
    "PullCubeTool-v1": Task(motion_planning=True),
    "DrawTriangle-v1": Task(motion_planning=True),
    "DrawSVG-v1": Task(motion_planning=True),
    # Meta-World v3 (module docstring)
    "pick-place-v3": _metaworld(150),
    "push-v3": _metaworld(150),
    "assembly-v3": _metaworld(200),
    "shelf-place-v3": _metaworld(200),
    "disassemble-v3": _metaworld(250),
    "stick-pull-v3": _metaworld(250),
    "peg-insert-side-v3": _metaworld(300),
}

MOTION_PLANNING_ENVS = tuple(env_id for env_id, t in TASKS.items() if t.motion_planning)


def is_metaworld(env_id: str) -> bool:
    """A Meta-World v3 task name (by its form: lower case, ending in ``-v3``), installed or not."""
    return bool(METAWORLD_NAME.fullmatch(env_id))


def task(env_id: str) -> Task:
    """``env_id``'s particulars, or ``GENERIC``'s (``METAWORLD_GENERIC``'s for a Meta-World name) without an entry."""
    return TASKS.get(env_id, METAWORLD_GENERIC if is_metaworld(env_id) else GENERIC)
