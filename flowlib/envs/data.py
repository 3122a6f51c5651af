"""Demonstrations: generate with ManiSkill's motion planner, replay to state + ``pd_ee_delta_pos``,
load as episodes, and cut into (observation window, action chunk) training pairs.

Generation (``generate_demos``) runs ManiSkill's own tools, unchanged, in subprocesses:

1. ``mani_skill.examples.motionplanning.panda.run``: motion-planning solutions (``mplib==0.1.1``,
   ``numpy<2``) recorded as joint-position actions;
2. ``mani_skill.trajectory.replay_trajectory``: replayed into state observations and
   ``pd_ee_delta_pos`` actions, with ``normalized_dense`` rewards recorded.

The result is cached as ``outputs/data/<env>/demos_<n>.state.pd_ee_delta_pos.physx_cpu.h5`` (+ .json).
Any ManiSkill .h5 with state observations in ``pd_ee_delta_pos`` loads the same way.  A Meta-World task's demos are
its scripted expert's, with the task's seeded action noise (``flowlib.envs.metaworld_envs.expert_episodes``), and a fast
task's its scripted demonstrator's; both are written in the same format.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from flowlib.envs.fast_tasks import FAST_TASKS, demonstrate
from flowlib.envs.maniskill import check_env_id, clear_grasp_at_reset, is_fast
from flowlib.envs.maniskill import control_mode as task_control_mode
from flowlib.envs.metaworld_envs import expert_episodes
from flowlib.envs.tasks import DEFAULT_CONTROL_MODE, MOTION_PLANNING_ENVS, is_metaworld, task
from flowlib.infra import progress
from flowlib.infra.runs import outputs_root


@dataclass
class Episode:
    """One demonstration. ``T`` steps: ``obs`` has ``T + 1`` rows (the last is after the last action)."""

    obs: np.ndarray         # [T+1, O]
    actions: np.ndarray     # [T, A]
    rewards: np.ndarray     # [T]  dense (normalized_dense) reward
    success: np.ndarray     # [T]  success flag after each step; the sparse reward is success.astype(float)
    terminated: np.ndarray  # [T]
    truncated: np.ndarray   # [T]  (time limit; not termination)
    seed: int | None = None  # the env seed it was reset with (evaluation must use other seeds)

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def sparse_rewards(self) -> np.ndarray:
        return self.success.astype(np.float32)


def demo_dir(env_id: str) -> Path:
    return outputs_root() / "data" / env_id


def demo_path(env_id: str, num_demos: int) -> Path:
    if is_metaworld(env_id):  # the noise is part of the name: another noise is another demo set
        return demo_dir(env_id) / (f"demos_{num_demos}.state.{task_control_mode(env_id)}.mujoco."
                                   f"noise{task(env_id).demo_noise:g}.h5")
    if is_fast(env_id):
        return demo_dir(env_id) / f"demos_{num_demos}.state.{task_control_mode(env_id)}.torch.h5"
    return demo_dir(env_id) / f"demos_{num_demos}.state.{task_control_mode(env_id)}.physx_cpu.h5"


def generate_demos(env_id: str = "PickCube-v1", num_demos: int = 100, num_procs: int = 1, force: bool = False) -> Path:
    """Motion-planned demos replayed to state obs and the task's control mode (``flowlib.envs.tasks``: ``pd_ee_delta_pos``
    unless the task needs another); cached, so a second call is free.  For a
    fast torch task (``flowlib.envs.fast_envs``), its scripted demonstrator's episodes (env seeds 0 on), failures kept.  For
    a Meta-World task, its scripted expert's with ``flowlib.envs.tasks``' ``demo_noise`` on each action (env seeds 0 on,
    each ended at its first success or the task's episode length), failures kept."""
    check_env_id(env_id)
    if is_metaworld(env_id):
        out = demo_path(env_id, num_demos)
        if force or not out.exists():
            t0, noise = time.time(), task(env_id).demo_noise
            episodes = [Episode(**e) for e in expert_episodes(env_id, list(range(num_demos)), noise, task(env_id).episode_steps)]
            save_episodes(out, episodes, env_id, task_control_mode(env_id),
                          source=f"metaworld.policies scripted expert, Gaussian action noise std {noise:g} "
                                 "(flowlib.envs.metaworld_envs.expert_episodes)")
            progress.say(f"{env_id}: {num_demos} expert demos ({sum(e.success.any() for e in episodes)} succeed) "
                         f"in {time.time() - t0:.0f} s")
        return out
    if is_fast(env_id):
        out = demo_path(env_id, num_demos)
        if force or not out.exists():
            save_episodes(out, scripted_demos(env_id, num_demos), env_id, task_control_mode(env_id),
                          source="flowlib.envs.fast_envs.demonstrate")
        return out
    if env_id not in MOTION_PLANNING_ENVS:
        raise ValueError(f"ManiSkill has no motion-planning solution for {env_id}; ones that do: {MOTION_PLANNING_ENVS}. "
                         "Pass your own demos with demo_file=... instead.")
    out = demo_path(env_id, num_demos)
    if out.exists() and not force:
        return out
    raw_dir = demo_dir(env_id) / "raw"
    if raw_dir.exists():
        shutil.rmtree(raw_dir)
    name, mode = f"demos_{num_demos}", task_control_mode(env_id)
    _run([sys.executable, "-m", "mani_skill.examples.motionplanning.panda.run", "-e", env_id, "-n", str(num_demos),
          "--only-count-success", "-b", "cpu", "--record-dir", str(raw_dir), "--traj-name", name,
          "--num-procs", str(num_procs)], "motion planning")
    raw = raw_dir / env_id / "motionplanning" / f"{name}.h5"
    _run([sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", "--traj-path", str(raw),
          "--use-first-env-state", "-c", mode, "-o", "state", "--save-traj", "-b", "physx_cpu",
          "--record-rewards", "--reward-mode", "normalized_dense", "--num-envs", str(num_procs)], "replay")
    replayed = raw.with_name(f"{name}.state.{mode}.physx_cpu.h5")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(replayed.with_suffix(".json"), out.with_suffix(".json"))
    shutil.move(replayed, out)  # the .h5 last: its presence marks a finished cache
    shutil.rmtree(raw_dir)
    return out


def scripted_demos(env_id: str, num_demos: int, first_seed: int = 0, num_envs: int = 256):
    """``num_demos`` episodes of the scripted demonstrator (``flowlib.envs.data.Episode``), env seeds ``first_seed`` on.
    Unlike ManiSkill's motion planner this keeps the failed ones too: the data's imperfection is the point."""
    episodes = []
    for first in range(first_seed, first_seed + num_demos, num_envs):
        n = min(num_envs, first_seed + num_demos - first)
        env = FAST_TASKS[env_id](n, backend="torch_cpu")
        obs, gen = [env.reset(seed=first)], torch.Generator().manual_seed(first)
        acts, rews, succ, trunc = [], [], [], []
        for _ in range(env.max_episode_steps):
            a = demonstrate(env, gen)
            o, r, _, tr, s = env.step(a)
            obs.append(o), acts.append(a), rews.append(r), succ.append(s), trunc.append(tr)
        stack = [torch.stack(x, 1).numpy() for x in (obs, acts, rews, succ, trunc)]
        for i in range(n):
            episodes.append(Episode(stack[0][i].astype(np.float32), stack[1][i].astype(np.float32),
                                    stack[2][i].astype(np.float32), stack[3][i], stack[3][i].copy(),
                                    stack[4][i], seed=first + i))
    return episodes


def _run(cmd: list[str], what: str) -> None:
    """Run one of ManiSkill's tools; its progress (the last of its tqdm redraws) is shown every
    ``progress.LINE_INTERVAL_S`` as ``motion planning: 37/150 ...``, its errors end in a ``RuntimeError``."""
    progress.say(f"{what}: {' '.join(Path(c).name if c == sys.executable else c for c in cmd[:4])} ...")
    t0, shown, tail = time.time(), time.time(), ""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for chunk in iter(lambda: proc.stderr.read1(4096), b""):
        tail = (tail + chunk.decode(errors="replace"))[-3000:]
        if time.time() - shown >= progress.LINE_INTERVAL_S:
            last = [p.strip() for p in re.split(r"[\r\n]", tail) if p.strip()]
            if last:
                progress.say(f"{what}: {last[-1][:160]}")
            shown = time.time()
    if proc.wait() != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd[:4])} ...):\n{tail}")
    progress.say(f"{what}: done in {time.time() - t0:.0f} s")


def load_demos(path: str | Path, control_mode: str | None = None, max_episodes: int | None = None) -> list[Episode]:
    """Episodes of a ManiSkill trajectory file (``.h5`` with its ``.json``); checks obs and control mode (the
    task's own, ``flowlib.envs.maniskill.control_mode``, unless ``control_mode`` names one).
    Each first observation gets what ``flowlib.envs.maniskill.ManiSkillVecEnv.reset`` gives a policy: the grasp flag that
    the replay's reset carried over from the previous demo cleared (``flowlib.envs.maniskill.clear_grasp_at_reset``)."""
    import h5py

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"demo file {path} not found: generate demos with flowlib.envs.data.generate_demos(env_id, n) "
                                "or point demo_file at an existing ManiSkill .h5")
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta:
        kwargs = meta.get("env_info", {}).get("env_kwargs", {})
        found = kwargs.get("control_mode")
        if control_mode is None:
            control_mode = task_control_mode(meta.get("env_info", {}).get("env_id", ""))
        if found is not None and found != control_mode:
            raise ValueError(f"{path.name} was recorded with control_mode={found!r}, this pipeline needs {control_mode!r}. "
                             f"Convert it: python -m mani_skill.trajectory.replay_trajectory --traj-path {path} "
                             f"-c {control_mode} -o state --save-traj --use-first-env-state -b physx_cpu --record-rewards")
        if kwargs.get("obs_mode") not in (None, "state"):
            raise ValueError(f"{path.name} has obs_mode={kwargs.get('obs_mode')!r}; replay it with -o state")
    seeds = {e["episode_id"]: e.get("episode_seed") for e in meta.get("episodes", [])}
    env_id = meta.get("env_info", {}).get("env_id")
    episodes = []
    with h5py.File(path, "r") as f:
        keys = sorted((k for k in f.keys() if k.startswith("traj_")), key=lambda k: int(k.split("_")[1]))
        for key in keys[:max_episodes]:
            g = f[key]
            if "rewards" not in g:
                raise ValueError(f"{path.name}/{key} has no rewards: replay with --record-rewards "
                                 "(later stages need dense and sparse rewards)")
            if not isinstance(g["obs"], h5py.Dataset):
                raise ValueError(f"{path.name}/{key}: obs is not a flat state vector; replay with -o state")
            obs = np.asarray(g["obs"], dtype=np.float32)  # [T+1, O]
            clear_grasp_at_reset(env_id, obs[0])  # the replay's reset left the previous demo's grasp in it
            episodes.append(Episode(
                obs=obs, actions=np.asarray(g["actions"], dtype=np.float32),
                rewards=np.asarray(g["rewards"], dtype=np.float32), success=np.asarray(g["success"], dtype=bool),
                terminated=np.asarray(g["terminated"], dtype=bool), truncated=np.asarray(g["truncated"], dtype=bool),
                seed=seeds.get(int(key.split("_")[1]))))
    if not episodes:
        raise ValueError(f"{path} holds no trajectories")
    return episodes


def save_episodes(path: str | Path, episodes: list[Episode], env_id: str, control_mode: str = DEFAULT_CONTROL_MODE,
                  source: str = "") -> Path:
    """Write episodes in ManiSkill's trajectory format (``traj_<i>`` groups + ``.json``), so that
    ``load_demos`` (and ManiSkill's tools) read them like replayed demos.  Atomic: the ``.h5`` appears last."""
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        for i, ep in enumerate(episodes):
            g = f.create_group(f"traj_{i}")
            for key in ("obs", "actions", "rewards", "success", "terminated", "truncated"):
                g.create_dataset(key, data=getattr(ep, key))
    meta = {"env_info": {"env_id": env_id, "env_kwargs": {"obs_mode": "state", "control_mode": control_mode}},
            "source": source,
            "episodes": [{"episode_id": i, "episode_seed": ep.seed, "elapsed_steps": len(ep),
                          "success": bool(ep.success.any())} for i, ep in enumerate(episodes)]}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    tmp.replace(path)
    return path


def check_held_out(name: str, first_seed: int, num_episodes: int, episodes: list[Episode]) -> None:
    """Evaluation on env seeds ``first_seed .. first_seed + num_episodes - 1`` must not reuse the initial
    states of training episodes (demos, rollouts): that measures memorisation, not the policy.
    Episodes of unknown seed (user files without ``episode_seed``) cannot be checked and are skipped."""
    used = {e.seed for e in episodes if e.seed is not None}
    clash = sorted(used & set(range(first_seed, first_seed + num_episodes)))
    if clash:
        raise ValueError(f"{name}={first_seed} evaluates on env seeds {first_seed}..{first_seed + num_episodes - 1}, but "
                         f"{len(clash)} of them ({clash[:5]}...) started training episodes: the score would measure "
                         f"memorisation. Set {name} to a seed >= {max(used) + 1} (the defaults are held out).")


class Normalizer(torch.nn.Module):
    """Per-dimension affine normalisation, stored with the checkpoint.

    ``mode="minmax"`` maps ``[min, max]`` to ``[-1, 1]``; ``mode="meanstd"`` to zero mean and unit
    standard deviation.  Constant dimensions get a unit scale (no division by zero).
    """

    MODES = ("minmax", "meanstd")

    def __init__(self, dim: int, mode: str = "meanstd"):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"normalizer mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self.register_buffer("shift", torch.zeros(dim))
        self.register_buffer("scale", torch.ones(dim))

    @classmethod
    def fit(cls, x: np.ndarray | torch.Tensor, mode: str = "meanstd", eps: float = 1e-4) -> "Normalizer":
        x = torch.as_tensor(x, dtype=torch.float32).reshape(-1, x.shape[-1])
        norm = cls(x.shape[-1], mode)
        if mode == "minmax":
            lo, hi = x.min(0).values, x.max(0).values
            norm.shift.copy_((hi + lo) / 2)
            norm.scale.copy_(torch.where(hi - lo > eps, (hi - lo) / 2, torch.ones_like(lo)))
        else:
            std = x.std(0)
            norm.shift.copy_(x.mean(0))
            norm.scale.copy_(torch.where(std > eps, std, torch.ones_like(std)))
        return norm

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.shift) / self.scale

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift

    def get_extra_state(self):
        return {"mode": self.mode}

    def set_extra_state(self, state):
        self.mode = state["mode"]


class ChunkDataset(Dataset):
    """(observation window, action chunk) pairs cut from episodes, as in Diffusion Policy.

    Sample ``i`` starts at ``s``: ``obs[s : s + obs_horizon]`` (``[To, O]``) and
    ``actions[s : s + pred_horizon]`` (``[H, A]``), for ``s`` from ``-(obs_horizon - 1)`` to
    ``T - obs_horizon`` (every step at which the policy acts, the last included).  Out-of-episode
    rows are padded: before the start with the first observation / action; after the end with a
    zero arm action and the last gripper command (``pd_ee_delta_pos`` is a delta: zero = hold
    still; ``gripper=False`` for tasks without one, such as the fast tasks: every dim zero).  The policy
    executes ``chunk[obs_horizon - 1 : obs_horizon - 1 + act_horizon]``.  Observations are standardised;
    actions are min-max scaled to ``[-1, 1]`` (``action_norm="minmax"``, Diffusion Policy's) or standardised
    (``"meanstd"``): where the demos' actions fill a small part of their range, as the push demonstrator's, a
    velocity net's error in normalised units costs twice the raw precision under min-max (docs/fast_tasks.md).
    """

    def __init__(self, episodes: list[Episode], obs_horizon: int = 2, pred_horizon: int = 16,
                 obs_normalizer: Normalizer | None = None, action_normalizer: Normalizer | None = None,
                 delta_actions: bool = True, action_norm: str = "minmax", gripper: bool = True):
        if pred_horizon < obs_horizon:
            raise ValueError(f"pred_horizon ({pred_horizon}) must be >= obs_horizon ({obs_horizon})")
        self.obs_horizon, self.pred_horizon = obs_horizon, pred_horizon
        self.episodes = episodes
        self.delta_actions, self.gripper = delta_actions, gripper
        self.index = [(e, s) for e, ep in enumerate(episodes) for s in range(-(obs_horizon - 1), len(ep) - obs_horizon + 1)]
        # copies of given normalisers (a policy's, in stage 2): training moves that policy to the GPU, not these
        self.obs_normalizer = (Normalizer.fit(np.concatenate([ep.obs for ep in episodes]), "meanstd")
                               if obs_normalizer is None else copy.deepcopy(obs_normalizer).cpu())
        self.action_normalizer = (Normalizer.fit(np.concatenate([ep.actions for ep in episodes]), action_norm)
                                  if action_normalizer is None else copy.deepcopy(action_normalizer).cpu())

    @property
    def obs_dim(self) -> int:
        return self.episodes[0].obs.shape[-1]

    @property
    def action_dim(self) -> int:
        return self.episodes[0].actions.shape[-1]

    def __len__(self) -> int:
        return len(self.index)

    def window(self, e: int, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw (un-normalised) ``obs [To, O]`` and ``actions [H, A]`` starting at step ``s`` of episode ``e``."""
        ep = self.episodes[e]
        T = len(ep)
        obs_idx = np.clip(np.arange(s, s + self.obs_horizon), 0, T)
        obs = ep.obs[obs_idx]
        act_idx = np.arange(s, s + self.pred_horizon)
        actions = ep.actions[np.clip(act_idx, 0, T - 1)].copy()
        after = act_idx >= T
        if after.any() and self.delta_actions:
            actions[after, :-1 if self.gripper else None] = 0.0  # hold still; keep the last gripper command
        return obs, actions

    @staticmethod
    def _normalized(normalizer: Normalizer, x: np.ndarray) -> torch.Tensor:  # on the normaliser's device
        with torch.no_grad():
            return normalizer.normalize(torch.from_numpy(x).to(normalizer.shift.device))

    def __getitem__(self, i: int):
        obs, actions = self.window(*self.index[i])
        # [To, O], [H, A]
        return self._normalized(self.obs_normalizer, obs), self._normalized(self.action_normalizer, actions)

    def tensors(self, obs_normalizer: Normalizer | None = None, action_normalizer: Normalizer | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sample at once, normalised: ``obs [N, To, O]``, ``actions [N, H, A]`` (for fast batching), by the
        dataset's normalisers or the given ones (a policy's: training normalises as the policy does), on their device."""
        windows = [self.window(e, s) for e, s in self.index]
        obs, actions = np.stack([w[0] for w in windows]), np.stack([w[1] for w in windows])
        return (self._normalized(self.obs_normalizer if obs_normalizer is None else obs_normalizer, obs),
                self._normalized(self.action_normalizer if action_normalizer is None else action_normalizer, actions))
