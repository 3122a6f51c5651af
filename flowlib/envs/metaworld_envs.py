"""Meta-World (MuJoCo) tasks behind ``flowlib.envs``' batched torch interface, on the CPU cores.

Meta-World v3 (``metaworld`` 3.1.x, MuJoCo 3.3) is one of the seeds' three benchmarks, and on a CPU it steps ~4.7x
faster than ManiSkill's ``physx_cpu`` (benchmarks/metaworld_throughput.py).  A task is named as Meta-World names it
(``pick-place-v3``); ``make_env`` sends such names here.  What a policy sees and does:

* observation: Meta-World's 39 state dims, ``[hand xyz, gripper opening, object 1 pos + quat, object 2 pos + quat]``
  (18), the same 18 one step earlier, and the goal (3).  The goal is observed, as in Meta-World's MT benchmarks;
* action: 4 dims in ``[-1, 1]``: the hand's mocap target moves by ``action[:3] / 100`` m (``mocap_delta_pos``) and
  ``action[3]`` is the gripper's effort;
* reward: ``normalized_dense`` is Meta-World's v2 shaped reward / 10 (in ``[0, 1]``; near 1 at the goal, though a
  solved step can earn less: success has its own threshold);
  ``dense`` is the reward itself; ``sparse`` is the success flag;
* ``success`` is Meta-World's ``info["success"]``; ``terminated`` is always false (Meta-World never terminates, as ManiSkill under
  ``ignore_terminations``); ``truncated`` turns true at ``flowlib.envs.tasks``' episode length and stays true.  The env
  keeps stepping after it, as a chunk runner needs: Meta-World's own 500-step guard is lifted;
* ``task_flags``: ``grasp_success`` and ``near_object``, Meta-World's per-step evaluation entries, as true/false;
* vectorised by worker processes that each step a group of envs (``flowlib.envs.vector.EnvGroups``, one per core).

Seeding.  Meta-World's benchmark classes (``MT1`` ...) draw 50 object and goal positions per task once, and every
reset picks one of those 50: training and evaluation would share initial states.  Here each env is built from its
task class with the positions sampled afresh at every reset (``_freeze_rand_vec = False``) from the env's own seeded
generator (``seeded_rand_vec = True``), and ``reset(seed=s)`` seeds that generator with ``s`` first (Meta-World's
``reset`` ignores its ``seed``; ``env.seed(s)`` is its way).  So episode ``s``'s positions are a function of ``s``
alone: not of ``num_envs``, of the worker, or of what ran before.  They are drawn uniformly from the task's continuous
reset box, so distinct seeds give distinct positions (with probability 1), and the held-out evaluation seeds
(``eval_seed`` 20,000 on, ``flowlib.tools.evaluate`` 30,000 on) never meet the demos' (0 on) or training's (2,000,000 on);
``tests/test_metaworld.py`` checks both.

Demonstrations come from Meta-World's scripted experts (``metaworld.policies``), made imperfect on purpose with
seeded Gaussian action noise (``expert_episodes``), so that behaviour cloning leaves RL room.
"""
from __future__ import annotations

import difflib
import functools
import os
import warnings

import numpy as np
import torch

from flowlib.envs.fast_envs import EnvSpec
from flowlib.envs.tasks import METAWORLD_CONTROL_MODE as CONTROL_MODE
from flowlib.envs.tasks import is_metaworld, task  # noqa: F401  (is_metaworld: re-exported)
from flowlib.envs.vector import EnvGroups

OBS_DIM, ACTION_DIM = 39, 4
BACKEND = "mujoco_cpu"
REWARD_SCALE = 10.0  # Meta-World's v2 rewards lie in [0, 10]
FLAGS = ("grasp_success", "near_object")  # info entries reported as task flags
INSTALL_HINT = ("install the metaworld extra: pip install -e '.[metaworld]' (`make install` does), which brings "
                "metaworld 3.1 and MuJoCo 3.3")


def _metaworld():
    """The ``metaworld`` package, or one clear line saying how to install it."""
    try:
        import metaworld.env_dict  # noqa: F401
        import metaworld.policies  # noqa: F401
    except ImportError as err:
        raise ImportError(f"Meta-World tasks need the metaworld package ({err}); {INSTALL_HINT}") from None
    import metaworld

    return metaworld


def task_names() -> list[str]:
    """Every Meta-World v3 task name (needs the extra)."""
    return sorted(_metaworld().env_dict.ALL_V3_ENVIRONMENTS)


def check_task(env_id: str) -> None:
    """Stop with one line on a name Meta-World does not have (with the closest ones), or on a missing extra."""
    names = task_names()
    if env_id not in names:
        close = difflib.get_close_matches(env_id, names, n=3)
        raise ValueError(f"unknown Meta-World task {env_id!r}" + (f"; did you mean {close}?" if close else "")
                         + f" ({len(names)} v3 tasks, e.g. pick-place-v3, peg-insert-side-v3, assembly-v3)")


def build_task_env(env_id: str, render: bool = False, camera_size: int = 128):
    """One Meta-World env of ``env_id`` with the goal observed and positions drawn at each reset from its seeded
    generator (module docstring), Meta-World's 500-step guard lifted.  Rendering uses MuJoCo's OSMesa backend
    (``libosmesa6``, ``make system-deps``) unless ``MUJOCO_GL`` says otherwise; it must be chosen before MuJoCo's
    first import in the process, so a rendering env lives in its own worker process (``MetaWorldVecEnv``)."""
    if render:
        os.environ.setdefault("MUJOCO_GL", "osmesa")
        os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    check_task(env_id)
    cls = _metaworld().env_dict.ALL_V3_ENVIRONMENTS[env_id]
    kwargs = dict(render_mode="rgb_array", camera_name="corner", width=camera_size, height=camera_size) if render else {}
    env = cls(**kwargs)
    env._partially_observable = False  # the goal is part of the observation (Meta-World's MT setting)
    env._freeze_rand_vec = False       # new object and goal positions at every reset ...
    env.seeded_rand_vec = True         # ... drawn from the env's seeded generator, not numpy's global one
    env._set_task_called = True
    env.__dict__.pop("sawyer_observation_space", None)  # a cached_property: recomputed with the goal observable
    env.max_path_length = 2**62  # truncation is ours (MetaWorldTask): stepping past it stays legal
    return env


def expert(env_id: str):
    """Meta-World's scripted expert for ``env_id``: ``get_action(obs [39]) -> action [4]``.  Its gains saturate the
    action box on purpose; Meta-World's warning that says so at every step is silenced."""
    check_task(env_id)
    warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high", category=UserWarning)
    return _metaworld().policies.ENV_POLICY_MAP[env_id]()


class MetaWorldTask:
    """One seeded Meta-World env: ``reset(seed) -> obs [39]``, ``step(action [4]) -> (obs, reward, truncated, success,
    flags)`` with float32 observations, this module's reward modes and truncation (module docstring)."""

    def __init__(self, env_id: str, max_episode_steps: int, reward_mode: str = "normalized_dense", render: bool = False,
                 camera_size: int = 128):
        self.env = build_task_env(env_id, render, camera_size)
        self.max_episode_steps, self.reward_mode, self.elapsed = max_episode_steps, reward_mode, 0

    def reset(self, seed: int) -> np.ndarray:
        self.env.seed(int(seed))  # Meta-World's reset ignores its seed argument; this seeds the positions
        obs, _ = self.env.reset()
        self.elapsed = 0
        return obs.astype(np.float32)

    def step(self, action: np.ndarray):
        obs, reward, _, _, info = self.env.step(np.asarray(action, dtype=np.float32))
        self.elapsed += 1
        success = bool(info["success"])
        reward = {"normalized_dense": reward / REWARD_SCALE, "dense": reward, "sparse": float(success)}[self.reward_mode]
        flags = [bool(info[name]) for name in FLAGS]
        return obs.astype(np.float32), float(reward), self.elapsed >= self.max_episode_steps, success, flags

    def render(self) -> np.ndarray:
        return self.env.render()

    def close(self) -> None:
        self.env.close()


class MetaWorldGroup:
    """The envs one worker steps in a loop (``flowlib.envs.vector.EnvGroups``), batched as numpy arrays."""

    def __init__(self, indices: list[int], env_id: str, max_episode_steps: int, reward_mode: str, render: bool,
                 camera_size: int):
        torch.set_num_threads(1)  # a worker only steps physics
        self.envs = [MetaWorldTask(env_id, max_episode_steps, reward_mode, render, camera_size) for _ in indices]
        self.obs = np.zeros((len(indices), OBS_DIM), np.float32)  # each env's latest observation

    def reset(self, seeds: list[int | None]) -> np.ndarray:
        """Reset the envs whose seed is given (``None``: keep running); the latest observations ``[M, 39]``."""
        for i, (env, seed) in enumerate(zip(self.envs, seeds)):
            if seed is not None:
                self.obs[i] = env.reset(seed)
        return self.obs  # pickled to the parent, or copied by its concatenate

    def step(self, actions: np.ndarray):
        """``actions [M, 4]`` -> obs ``[M, 39]``, reward ``[M]``, truncated ``[M]``, success ``[M]``, flags ``[M, F]``."""
        out = [env.step(a) for env, a in zip(self.envs, actions)]
        self.obs = np.stack([o[0] for o in out])
        return (self.obs, np.array([o[1] for o in out], np.float32), np.array([o[2] for o in out]),
                np.array([o[3] for o in out]), np.array([o[4] for o in out], bool).reshape(len(out), len(FLAGS)))

    def render(self) -> np.ndarray:
        return np.stack([env.render() for env in self.envs])

    def close(self) -> None:
        for env in self.envs:
            env.close()


class MetaWorldVecEnv:
    """``num_envs`` Meta-World envs with ``flowlib.envs.maniskill.ManiSkillVecEnv``'s batched torch interface (module
    docstring), on the CPU: ``num_workers`` processes (default one per core, at most one per env) each step a group of
    envs (``flowlib.envs.vector.EnvGroups``); a single env that does not render runs in this process."""

    REWARD_MODES = ("normalized_dense", "dense", "sparse")

    def __init__(self, env_id: str, num_envs: int = 1, max_episode_steps: int | None = None, backend: str = "auto",
                 obs_mode: str = "state", control_mode: str | None = None, reward_mode: str = "normalized_dense",
                 render: bool = False, fresh_scene: bool = False, camera_size: int = 128, num_points: int = 512,
                 num_workers: int | None = None):
        """``fresh_scene`` is accepted as ManiSkill's envs take it: a MuJoCo reset restores the whole state, so every
        episode is already history-free.  ``num_points`` is ManiSkill's; Meta-World has state observations only.
        Rendering needs a worker process (MuJoCo's GL backend is chosen at its import)."""
        check_task(env_id)
        if obs_mode != "state":
            raise ValueError(f"Meta-World tasks observe obs_mode 'state' (39 dims) only here, got {obs_mode!r}")
        if control_mode not in (None, CONTROL_MODE):
            raise ValueError(f"Meta-World's action is control_mode {CONTROL_MODE!r} (hand delta xyz, gripper), got "
                             f"{control_mode!r}")
        if reward_mode not in self.REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {self.REWARD_MODES}, got {reward_mode!r}")
        if backend not in ("auto", BACKEND, "physx_cpu"):
            raise ValueError(f"Meta-World runs MuJoCo on the CPU: backend 'auto' or {BACKEND!r}, got {backend!r} "
                             "(the policy may still sit on a GPU)")
        if num_workers is None:
            num_workers = 0 if num_envs == 1 and not render else min(num_envs, os.cpu_count() or 1)
        self.backend, self.device, self.num_envs = BACKEND, torch.device("cpu"), num_envs
        self.max_episode_steps = max_episode_steps or task(env_id).episode_steps
        make = functools.partial(MetaWorldGroup, env_id=env_id, max_episode_steps=self.max_episode_steps,
                                 reward_mode=reward_mode, render=render, camera_size=camera_size)
        self.groups = EnvGroups(make, num_envs, max(num_workers, 1 if render else 0))
        self.spec = EnvSpec(env_id, OBS_DIM, ACTION_DIM, CONTROL_MODE, self.max_episode_steps)
        self.task_flags: dict[str, torch.Tensor] = {}
        self.privileged: torch.Tensor | None = None  # [N, 39]: the observation itself (state observations)

    def _reset(self, seeds: list[int | None]) -> torch.Tensor:
        obs = self.groups.call("reset", [([seeds[i] for i in s],) for s in self.groups.slices])
        self.privileged = torch.as_tensor(np.concatenate(obs))  # a fresh array: nothing else holds it
        return self.privileged

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        """New episodes in every env: env ``i`` from ``seed + i`` (or ``seed[i]``; random seeds when None); obs
        ``[N, 39]``."""
        if isinstance(seed, list) and len(seed) != self.num_envs:
            raise ValueError(f"a seed list needs {self.num_envs} entries (one per env), got {len(seed)}")
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0] >> 1)
        self.task_flags = {}
        return self._reset(seed if isinstance(seed, list) else [seed + i for i in range(self.num_envs)])

    def reset_some(self, mask: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """Restart the envs where ``mask [N]`` is true, env ``i`` with ``seeds[i]``; obs ``[N, 39]`` (new first
        observations where reset; the others' latest)."""
        mask = torch.as_tensor(mask, dtype=torch.bool).cpu()
        if mask.shape != (self.num_envs,) or len(seeds) != self.num_envs:
            raise ValueError(f"mask and seeds must have {self.num_envs} entries, got {tuple(mask.shape)} and {len(seeds)}")
        if not mask.any():
            raise ValueError("reset_some needs at least one env to reset")
        return self._reset([int(s) if m else None for s, m in zip(seeds, mask.tolist())])

    def step(self, action: torch.Tensor):
        """``action [N, 4]`` -> ``obs [N, 39], reward [N], terminated [N], truncated [N], success [N]``;
        ``task_flags`` holds this step's ``grasp_success`` and ``near_object``."""
        if action.shape != (self.num_envs, ACTION_DIM):
            raise ValueError(f"action must be [{self.num_envs}, {ACTION_DIM}], got {tuple(action.shape)}")
        actions = action.detach().cpu().numpy()
        out = self.groups.call("step", [(actions[s],) for s in self.groups.slices])
        obs, reward, truncated, success, flags = (torch.as_tensor(np.concatenate(x)) for x in zip(*out))
        self.task_flags = {name: flags[:, j] for j, name in enumerate(FLAGS)}
        self.privileged = obs  # the state observation itself, as ManiSkillVecEnv's in obs mode state
        return obs, reward, torch.zeros(self.num_envs, dtype=torch.bool), truncated, success

    def snapshot(self) -> list:
        raise ValueError("snapshot / restore (branch advantages) are written for ManiSkill's physx_cpu and the fast "
                         "tasks, not Meta-World: set branches to 0")

    restore = snapshot

    def render(self) -> np.ndarray:
        """RGB frames ``[N, H, W, 3]`` (uint8) from the ``corner`` camera; needs ``render=True``."""
        return np.concatenate(self.groups.call("render"))

    def close(self) -> None:
        self.groups.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def expert_episodes(env_id: str, seeds: list[int], action_noise: float, max_episode_steps: int, noise_seed: int = 0):
    """Meta-World's scripted expert on env seeds ``seeds``, one episode each (``flowlib.envs.data.Episode`` fields as a
    dict), ended at its first success or at ``max_episode_steps``.  Imperfect on purpose: each executed action is the
    expert's plus ``N(0, action_noise^2)`` per dim, clipped to ``[-1, 1]``, drawn from a generator seeded by
    ``(noise_seed, env seed)``, so a demo set is reproducible and a demo does not depend on which others are made.
    Failed episodes are kept: stage 1 clones what the demonstrator did."""
    env = MetaWorldTask(env_id, max_episode_steps)
    policy = expert(env_id)
    episodes = []
    for s in seeds:
        rng = np.random.default_rng([noise_seed, s])
        obs = env.reset(s)
        trace = {"obs": [obs], "actions": [], "rewards": [], "success": []}
        for _ in range(max_episode_steps):
            action = np.clip(policy.get_action(obs.astype(np.float64)) + action_noise * rng.standard_normal(ACTION_DIM),
                             -1, 1).astype(np.float32)
            obs, reward, _, success, _ = env.step(action)
            for key, value in (("obs", obs), ("actions", action), ("rewards", reward), ("success", success)):
                trace[key].append(value)
            if success:
                break
        success = np.asarray(trace["success"], dtype=bool)
        truncated = np.zeros_like(success)
        truncated[-1] = not success[-1]
        episodes.append({"obs": np.asarray(trace["obs"], dtype=np.float32),
                         "actions": np.asarray(trace["actions"], dtype=np.float32),
                         "rewards": np.asarray(trace["rewards"], dtype=np.float32), "success": success,
                         "terminated": success.copy(), "truncated": truncated, "seed": int(s)})
    env.close()
    return episodes
