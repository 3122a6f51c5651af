"""ManiSkill3 environments behind one batched torch interface, on a GPU or on CPU cores.

``make_env(env_id, num_envs)`` picks the backend:

* CUDA present: ``physx_cuda`` with ``num_envs`` parallel envs in one process (ManiSkillVectorEnv);
* otherwise:    ``physx_cpu``, one env per process (SAPIEN's CPU backend allows one per process),
  vectorised with gymnasium's ``AsyncVectorEnv`` so ``num_envs`` envs use the cores.

Either way ``reset`` / ``step`` take and return batched torch tensors (``[N, ...]``).  Episodes
ignore termination (as in ManiSkill's evaluation) and end at ``max_episode_steps`` by truncation;
there is no auto-reset: call ``reset`` to start the next batch of episodes.

On ``physx_cpu`` the envs can also go back in time: ``snapshot()`` saves every env's simulator state
(and its step count), ``restore(states)`` puts it back, so several actions can be tried from one state
(``flowlib.methods.reinflow``'s branch advantages).  Replaying the same actions after a restore reproduces the
observations to ~1e-4 (3e-6 to 8e-5 measured over 8-10 actions).

A ``physx_cpu`` reset puts back every pose and velocity ManiSkill knows of (its state dict reads the same), but
PhysX keeps contact state of its own across resets: an episode that grips the cube can then run differently
by what the worker ran before (seen from step ~10 to ~30, 1e-7 growing to 5 cm; over 200 PickCube episodes of
a stage-3 policy, 2 flipped their success).  ``fresh_scene=True`` rebuilds each worker's scene at every reset
(ManiSkill's ``reconfiguration_freq=1``, ~0.2 s a reset), so an episode's result is a function of the policy
and its seed alone: ``flowlib.tools.evaluate`` uses it.  Training keeps the faster reset.
"""
from __future__ import annotations

import difflib
import functools
import platform
from pathlib import Path

import numpy as np
import torch

from flowlib.envs.fast_envs import CONTROL_MODE as FAST_CONTROL_MODE
from flowlib.envs.fast_envs import EnvSpec  # noqa: F401  (EnvSpec: every env's, re-exported)
from flowlib.envs.fast_tasks import FAST_TASKS
from flowlib.envs.metaworld_envs import MetaWorldVecEnv, check_task, is_metaworld
from flowlib.envs.tasks import task
from flowlib.envs.vector import vector_env
from flowlib.envs.visual import VISUAL_MODES, check_obs_mode, make_visual_env
from flowlib.infra import sysdeps


def clear_grasp_at_reset(env_id: str, obs):
    """First observations ``obs [..., O]`` (torch or numpy) with the contact flag a ``physx_cpu`` reset left from the
    previous episode set to its true value, 0 (``flowlib.envs.tasks``' ``stale_at_reset``: PickCube's ``is_grasped``,
    whose reset does not simulate the contacts again); in place, returned.  Tasks without such a flag, or an
    observation of another width (not ManiSkill 3.0.x's state layout), are returned unchanged.  Cleared on
    ``physx_cuda`` too (whether ManiSkill's GPU reset carries it over is unchecked: no GPU here)."""
    stale = task(env_id).stale_at_reset
    if stale is not None and obs.shape[-1] == stale[0]:
        obs[..., stale[1]] = 0
    return obs


def known_env_ids() -> list[str]:
    import mani_skill.envs  # noqa: F401  (registers the envs)
    from mani_skill.utils.registration import REGISTERED_ENVS

    return sorted([*REGISTERED_ENVS, *FAST_TASKS])


def is_fast(env_id: str) -> bool:
    """A pure-torch task of ``flowlib.envs.fast_envs`` (no simulator, no Vulkan)."""
    return env_id in FAST_TASKS


def control_mode(env_id: str) -> str:
    """The control mode a task's demonstrations and policies use: ``flowlib.envs.tasks``' (``pd_ee_delta_pos`` unless the
    task needs another), ``ee_delta_pos`` for the fast tasks."""
    return FAST_CONTROL_MODE if is_fast(env_id) else task(env_id).control_mode


def check_env_id(env_id: str) -> None:
    """Stop with one line on an env id no backend has (with a did-you-mean), or on a Meta-World task without its
    extra installed."""
    if is_fast(env_id):
        return
    if is_metaworld(env_id):
        return check_task(env_id)
    ids = known_env_ids()
    if env_id not in ids:
        close = difflib.get_close_matches(env_id, ids, n=3)
        raise ValueError(f"unknown ManiSkill env id {env_id!r}" + (f"; did you mean {close}?" if close else "")
                         + f" (e.g. PickCube-v1, PushCube-v1, StackCube-v1; fast torch tasks: {sorted(FAST_TASKS)}; "
                         "Meta-World tasks by their v3 names: pick-place-v3)")


def resolve_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "physx_cuda" if torch.cuda.is_available() else "physx_cpu"
    if backend not in ("physx_cuda", "physx_cpu"):
        raise ValueError(f"backend must be 'auto', 'physx_cuda' or 'physx_cpu', got {backend!r}")
    if backend == "physx_cuda" and not torch.cuda.is_available():
        raise ValueError("backend='physx_cuda' needs a CUDA GPU; use backend='auto' or 'physx_cpu'")
    return backend


def _make_cpu_env(env_id, obs_mode, control_mode, reward_mode, max_episode_steps, render, fresh_scene=False,
                  camera_size=64, num_points=512):
    """One single-process CPU env (numpy in/out), termination ignored: built inside the worker.  ``fresh_scene``:
    a new PhysX scene at every reset (module docstring).  A visual ``obs_mode`` packs each observation
    (``flowlib.envs.visual``)."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    torch.set_num_threads(1)  # a worker only steps physics; idle torch threads would compete for cores
    kwargs = dict(reward_mode=reward_mode, sim_backend="physx_cpu", render_mode="rgb_array" if render else None,
                  render_backend="sapien_cuda" if torch.cuda.is_available() else "sapien_cpu",  # no fallback warning
                  max_episode_steps=max_episode_steps, reconfiguration_freq=1 if fresh_scene else None)
    if obs_mode in VISUAL_MODES:
        env = make_visual_env(env_id, obs_mode, camera_size, num_points, control_mode, **kwargs)
    else:
        env = gym.make(env_id, obs_mode=obs_mode, control_mode=control_mode, **kwargs)
    return _restorable_wrapper()(CPUGymWrapper(env, ignore_terminations=True))


@functools.cache
def _restorable_wrapper():
    import gymnasium as gym

    class _Restorable(gym.Wrapper):
        """Outermost wrapper of a CPU worker's env: ``snapshot()`` returns the simulator state (ManiSkill's
        ``get_state_dict``) with the env's step count; assigning ``restore_to`` puts one back (an attribute,
        so that gymnasium's ``set_attr`` can send each worker its own state)."""

        def snapshot(self):
            base = self.env.unwrapped
            return {"sim": base.get_state_dict(), "elapsed": base._elapsed_steps.clone()}

        @property
        def restore_to(self):
            return None

        @restore_to.setter
        def restore_to(self, state):
            base = self.env.unwrapped
            base.set_state_dict(state["sim"])
            base._elapsed_steps[:] = state["elapsed"]

    return _Restorable


class ManiSkillVecEnv:
    """``num_envs`` ManiSkill envs with a batched torch interface (see module docstring)."""

    def __init__(self, env_id: str = "PickCube-v1", num_envs: int = 1, obs_mode: str = "state",
                 control_mode: str | None = None, reward_mode: str = "normalized_dense",
                 max_episode_steps: int | None = None, backend: str = "auto", render: bool = False,
                 fresh_scene: bool = False, camera_size: int = 64, num_points: int = 512):
        check_env_id(env_id)
        check_obs_mode(obs_mode)
        _check_vulkan()
        self.backend = resolve_backend(backend)
        if fresh_scene and self.backend == "physx_cuda":
            raise ValueError("fresh_scene rebuilds each physx_cpu worker's scene at its reset; physx_cuda runs all "
                             "envs in one scene, which ManiSkill cannot rebuild for some of them: use "
                             "backend='physx_cpu' for history-free episodes, or fresh_scene=False")
        self.num_envs = num_envs
        self.max_episode_steps = max_episode_steps or task(env_id).episode_steps
        control_mode = control_mode or task(env_id).control_mode
        self.device = torch.device("cuda" if self.backend == "physx_cuda" else "cpu")
        if self.backend == "physx_cuda":
            import gymnasium as gym
            import mani_skill.envs  # noqa: F401
            from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

            enable_physx_gpu()
            kwargs = dict(num_envs=num_envs, control_mode=control_mode, reward_mode=reward_mode, sim_backend="physx_cuda",
                          render_mode="rgb_array" if render else None, max_episode_steps=self.max_episode_steps)
            if obs_mode in VISUAL_MODES:
                env = make_visual_env(env_id, obs_mode, camera_size, num_points, **kwargs)
                state_dim = env.state_dim
            else:
                env = gym.make(env_id, obs_mode=obs_mode, **kwargs)
            self.env = ManiSkillVectorEnv(env, num_envs, auto_reset=False, ignore_terminations=True)
        else:
            make = functools.partial(_make_cpu_env, env_id, obs_mode, control_mode, reward_mode,
                                     self.max_episode_steps, render, fresh_scene, camera_size, num_points)
            self.env = vector_env(make, num_envs, in_process=num_envs == 1)
            if obs_mode in VISUAL_MODES:
                state_dim = self.env.get_attr("state_dim")[0]
        self.task_flags: dict[str, torch.Tensor] = {}  # set by each step
        obs_dim = int(np.prod(self.env.single_observation_space.shape))
        self.spec = EnvSpec(env_id, obs_dim, int(np.prod(self.env.single_action_space.shape)), control_mode,
                            self.max_episode_steps, obs_mode, state_dim if obs_mode in VISUAL_MODES else obs_dim)
        self.privileged: torch.Tensor | None = None  # [N, P] after each reset / step (see ``_privileged``)

    def _tensor(self, x, dtype=torch.float32) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x) if not torch.is_tensor(x) else x, dtype=dtype).to(self.device)

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        """Start ``num_envs`` new episodes; env ``i`` is seeded with ``seed + i`` (or ``seed[i]`` for a list;
        on physx_cuda a list needs a ManiSkill whose ``reset`` takes one seed per env). Returns obs ``[N, O]``,
        with what a reset leaves of the previous episode cleared (``clear_grasp_at_reset``): an episode's first
        observation, and so its result, does not depend on which episode its env ran before."""
        if isinstance(seed, list) and len(seed) != self.num_envs:
            raise ValueError(f"a seed list needs {self.num_envs} entries (one per env), got {len(seed)}")
        obs, info = self.env.reset(seed=seed)
        obs = clear_grasp_at_reset(self.spec.env_id, self._tensor(obs).reshape(self.num_envs, -1))
        self.privileged = self._privileged(obs, info, reset=True)
        return obs

    def reset_some(self, mask: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """Restart only the envs where ``mask [N]`` is true, env ``i`` with ``seeds[i]`` (the others keep
        running).  Returns obs ``[N, O]``: new first observations where reset (others: undefined, ignore)."""
        mask = torch.as_tensor(mask, dtype=torch.bool).cpu()
        if mask.shape != (self.num_envs,) or len(seeds) != self.num_envs:
            raise ValueError(f"mask and seeds must have {self.num_envs} entries, got {tuple(mask.shape)} and {len(seeds)}")
        if not mask.any():
            raise ValueError("reset_some needs at least one env to reset")
        if self.backend == "physx_cuda":
            # ManiSkill's GPU sim takes one seed list for all envs; partial resets draw their episode
            # seeds from its main RNG instead (seeded by the last full reset), reproducible all the same
            idx = torch.nonzero(mask).squeeze(1)
            obs, info = self.env.reset(options={"env_idx": idx.to(self.device)})
        else:
            obs, info = self.env.reset(seed=[int(s) for s in seeds], options={"reset_mask": mask.numpy()})
        obs = clear_grasp_at_reset(self.spec.env_id, self._tensor(obs).reshape(self.num_envs, -1))
        fresh = self._privileged(obs, info, reset=True)
        self.privileged = fresh if self.privileged is None else torch.where(mask.to(fresh.device)[:, None], fresh,
                                                                             self.privileged)
        return obs

    def step(self, action: torch.Tensor):
        """``action [N, A]`` -> ``obs [N, O], reward [N], terminated [N], truncated [N], success [N]``.

        The task's other true/false evaluation flags of this step (ManiSkill's ``evaluate()``: for PickCube
        ``is_grasped``, ``is_obj_placed``, ``is_robot_static``) are left in ``self.task_flags``, ``{name: [N]}``.
        (ManiSkill's ``reset`` computes ``is_grasped`` from the previous episode's last contacts; ``reset`` here
        clears it from the observation, see ``clear_grasp_at_reset``.)"""
        if action.shape != (self.num_envs, self.spec.action_dim):
            raise ValueError(f"action must be [{self.num_envs}, {self.spec.action_dim}], got {tuple(action.shape)}")
        act = action if self.backend == "physx_cuda" else action.detach().cpu().numpy()
        obs, reward, terminated, truncated, info = self.env.step(act)
        success = info.get("success", np.zeros(self.num_envs, dtype=bool))
        self.task_flags = {name: self._tensor(value, torch.bool) for name, value in info.items()
                           if name != "success" and not name.startswith("_") and _is_flag(value, self.num_envs)}
        obs = self._tensor(obs).reshape(self.num_envs, -1)
        self.privileged = self._privileged(obs, info)
        return (obs, self._tensor(reward), self._tensor(terminated, torch.bool), self._tensor(truncated, torch.bool),
                self._tensor(success, torch.bool))

    def _privileged(self, obs: torch.Tensor, info: dict, reset: bool = False) -> torch.Tensor:
        """``[N, P]``: ManiSkill's state observation of each env's present state, what an asymmetric critic reads: the
        observation itself in obs mode ``state``, else the visual worker's ``info["privileged_state"]``
        (``flowlib.envs.visual``), with a reset's stale contact flag cleared as ``obs``'s is."""
        if self.spec.obs_mode == "state":
            return obs
        state = self._tensor(info["privileged_state"]).reshape(self.num_envs, -1)
        return clear_grasp_at_reset(self.spec.env_id, state) if reset else state

    def snapshot(self) -> list:
        """Every env's simulator state and step count, to hand to ``restore`` (``physx_cpu`` only)."""
        self._check_restorable()
        return list(self.env.call("snapshot"))

    def restore(self, states: list) -> None:
        """Put every env back to ``states`` (from ``snapshot``); the next ``step`` continues from there."""
        self._check_restorable()
        if len(states) != self.num_envs:
            raise ValueError(f"restore needs {self.num_envs} states (one per env), got {len(states)}")
        self.env.set_attr("restore_to", list(states))

    def _check_restorable(self) -> None:
        if self.backend != "physx_cpu":
            raise ValueError(f"snapshot / restore need backend physx_cpu (one env per process), not {self.backend}")

    def render(self) -> np.ndarray:
        """RGB frames ``[N, H, W, 3]`` (uint8); needs ``render=True``."""
        frames = self.env.render()
        if torch.is_tensor(frames):
            return frames.cpu().numpy()
        return np.stack(list(frames))

    def close(self) -> None:
        self.env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _is_flag(value, num_envs: int) -> bool:
    """A per-env true/false entry of a step's info (not gymnasium's ``_name`` masks, which the caller skips
    by name, nor counters or nested dicts)."""
    dtype = value.dtype if torch.is_tensor(value) or isinstance(value, np.ndarray) else None
    return dtype in (torch.bool, np.dtype(bool)) and tuple(value.shape) == (num_envs,)


def make_env(env_id: str = "PickCube-v1", num_envs: int = 1, **kwargs):
    """``num_envs`` envs of ``env_id``: a ManiSkill task (``ManiSkillVecEnv``), a Meta-World task by its v3 name
    (``flowlib.envs.metaworld_envs``, MuJoCo on the CPU), or a fast torch task (``flowlib.envs.fast_envs``, whose ``backend`` is
    "auto", "torch_cpu" or "torch_cuda"; ManiSkill's names map to them, so one params file serves both)."""
    if is_metaworld(env_id):
        return MetaWorldVecEnv(env_id, num_envs, **kwargs)
    if is_fast(env_id):
        backend = kwargs.pop("backend", "auto")
        kwargs["backend"] = {"physx_cpu": "torch_cpu", "physx_cuda": "torch_cuda"}.get(backend, backend)
        return FAST_TASKS[env_id](num_envs, **kwargs)
    return ManiSkillVecEnv(env_id, num_envs, **kwargs)


def enable_physx_gpu() -> None:
    """Load SAPIEN's PhysX GPU library, which SAPIEN downloads from GitHub on first use into
    ``~/.sapien/physx/<version>/``.  On a machine that cannot reach GitHub that download fails deep inside
    ``gym.make``; fail here instead, saying where the file goes and what runs without it."""
    import sapien.physx

    try:
        sapien.physx.enable_gpu()
    except Exception as err:  # requests' ConnectionError, a bad zip, or the library failing to load
        where = Path.home() / ".sapien" / "physx" / sapien.physx.version()
        zip_name = "linux-aarch64-so.zip" if platform.machine() in ("aarch64", "arm64") else "linux-so.zip"
        url = f"https://github.com/sapien-sim/physx-precompiled/releases/download/{sapien.physx.version()}/{zip_name}"
        raise RuntimeError(f"physx_cuda needs SAPIEN's PhysX GPU library, which could not be loaded or downloaded "
                           f"({type(err).__name__}: {err}). Unzip {url} into {where} (it holds libPhysXGpu_64.so), "
                           "or run the physics on CPU with backend='physx_cpu'") from err


def _check_vulkan() -> None:
    if torch.cuda.is_available():
        return
    if sysdeps.mesa_major() is not None and not sysdeps.vulkan_ready():
        raise RuntimeError(f"ManiSkill on CPU needs Vulkan from Mesa >= {sysdeps.MESA_MIN_MAJOR} (found Mesa "
                           f"{sysdeps.mesa_major()}); run `make system-deps` (as root) to install it")
