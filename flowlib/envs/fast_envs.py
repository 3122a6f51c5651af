"""Fast vectorised tasks: thousands of planar envs stepped as torch tensors, behind ``flowlib.envs``' interface.

ManiSkill on ``physx_cpu`` serves ~360 env steps/s here, while chain-PPO wants 8k-20k decisions per update
(docs/stage3.md). These tasks cost microseconds per env step on CPU or CUDA, so sample-hungry methods can be watched
learning in minutes. They sit beside the simulator; they never stand in for its results.

Both tasks are kinematic and planar, in the box ``[-1, 1]^2``. The agent is a point (the pusher) that moves by
``action * MAX_STEP`` per step, ``action in [-1, 1]^2`` (control mode ``ee_delta_pos``). Each episode runs to its
time limit; ``success`` is reported every step, and ``terminated`` equals it, as ManiSkill's tasks report it.
``reward`` is the dense reward, in ``[0, 1]`` and 1 at success (as ManiSkill's ``normalized_dense``).

``FastReach-v0``: reach a goal. obs ``[p, g, g - p]`` (6). Success: ``|g - p| < 0.05``. Dense reward
``1 - tanh(3 |g - p|)``. 40 steps.

``FastPush-v0``: push a disc of radius 0.1 onto a goal with a point pusher of radius 0.05. obs ``[p, c, g, c - p,
g - c]`` (10). When the moved pusher overlaps the disc, the disc slides out along the contact normal ``n`` and takes a
share ``mu = 0.8`` of the pusher's motion ``d`` across it (quasi-static pushing with friction):
``c' = p' + (r_p + r_o) n + mu (d - (d . n) n)``, ``n = (c - p') / |c - p'|``, clipped to the box. The pusher starts behind the
disc, roughly in line with the goal. Success: ``|g - c| < 0.03``,
so the last centimetres matter, as on PickCube. Dense reward ``(reach + 3 place) / 4`` with ``reach = 1 - tanh(5
|b - p|)`` (``b`` the point behind the disc, opposite the goal) and ``place = 1 - tanh(5 |g - c|)``. 80 steps.
Evaluation flags: ``is_contact`` (the pusher touched the disc this step), ``is_obj_near`` (``|g - c| < 0.1``).

``FastAvoid-v0`` (``flowlib.envs.fast_avoid``), whose demonstrations have two modes, is the third; all three are
``flowlib.envs.fast_tasks.FAST_TASKS``.

Each has a scripted demonstrator (``demonstrate``) that is deliberately imperfect (module ``DEMO_*`` settings), so
that behaviour cloning from it plateaus below full success and RL has something to gain: the reach demonstrator
moves at part speed with a per-episode heading error; the push demonstrator goes behind the disc and pushes it towards
the goal at part speed, with a per-episode angle error, slowing as the disc nears the goal (so it stops on it). Both
fail mostly by running out of time, which a faster, straighter policy does not.

Seeding: env ``i`` reset with seed ``s`` draws its initial state (and the demonstrator its per-episode errors) from
``torch.Generator().manual_seed(s)``, so an episode depends on its seed alone, not on ``num_envs`` or the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flowlib._moved import moved_names

CONTROL_MODE = "ee_delta_pos"
MAX_STEP = 0.05  # the agent's largest move per step (box units)


@dataclass
class EnvSpec:
    """What a policy must fit in an env (``flowlib.policies.chunk_policy.check_compatible``): every env's, ManiSkill's and these."""

    env_id: str
    obs_dim: int
    action_dim: int
    control_mode: str
    max_episode_steps: int
    obs_mode: str = "state"  # or a visual mode of flowlib.envs.visual: observations are packed frames
    state_dim: int = 0  # ManiSkill's state observation's width (the env's ``privileged``); 0: none beyond ``obs``


class FastVecEnv:
    """``num_envs`` planar envs as tensors (module docstring): ``reset``, ``reset_some``, ``step``, ``task_flags``,
    ``snapshot`` / ``restore`` and ``render``, as ``flowlib.envs.maniskill.ManiSkillVecEnv`` has them."""

    env_id = ""
    obs_dim, action_dim, default_episode_steps = 0, 2, 0
    state_keys: tuple[str, ...] = ()

    def __init__(self, num_envs: int = 1, max_episode_steps: int | None = None, backend: str = "auto",
                 obs_mode: str = "state", control_mode: str = CONTROL_MODE, reward_mode: str = "normalized_dense",
                 render: bool = False, fresh_scene: bool = False):
        """``render`` and ``fresh_scene`` are accepted as ManiSkill's envs take them: these envs always render and
        keep no state across a reset."""
        if obs_mode != "state" or control_mode != CONTROL_MODE or reward_mode != "normalized_dense":
            raise ValueError(f"{self.env_id} has obs_mode 'state', control_mode {CONTROL_MODE!r} and reward_mode "
                             f"'normalized_dense' only, got {obs_mode!r}, {control_mode!r}, {reward_mode!r}")
        if backend not in ("auto", "torch", "torch_cpu", "torch_cuda"):
            raise ValueError(f"{self.env_id} runs on backend 'auto', 'torch_cpu' or 'torch_cuda' (pure torch), got "
                             f"{backend!r}")
        cuda = backend == "torch_cuda" or (backend == "auto" and torch.cuda.is_available())
        if cuda and not torch.cuda.is_available():
            raise ValueError("backend 'torch_cuda' needs a CUDA GPU; use 'auto' or 'torch_cpu'")
        self.device = torch.device("cuda" if cuda else "cpu")
        self.backend = "torch_cuda" if cuda else "torch_cpu"
        self.num_envs = num_envs
        self.max_episode_steps = max_episode_steps or self.default_episode_steps
        self.spec = EnvSpec(self.env_id, self.obs_dim, self.action_dim, CONTROL_MODE, self.max_episode_steps)
        self.state = {k: torch.zeros(num_envs, 2, device=self.device) for k in self.state_keys}
        self.elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.task_flags: dict[str, torch.Tensor] = {}
        self.demo_params = torch.zeros(num_envs, 2, device=self.device)  # the demonstrator's per-episode errors

    # the task: subclasses
    def _initial(self, generator: torch.Generator) -> dict[str, torch.Tensor]:  # one env's state, each [2]
        raise NotImplementedError

    def _move(self, p_next: torch.Tensor) -> dict[str, torch.Tensor]:  # [N, 2] -> the state after the move
        raise NotImplementedError

    def _evaluate(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:  # success, dense reward, flags
        raise NotImplementedError

    def obs(self) -> torch.Tensor:
        raise NotImplementedError

    # the interface
    def _reset_rows(self, rows: list[int], seeds: list[int]) -> None:
        """Episode ``rows[j]`` from ``seeds[j]`` alone: each is drawn on the CPU from its own generator, then every
        state key is written in one copy (on CUDA, not one small copy and index kernel per env and key)."""
        initial, demo_params = [], []
        for s in seeds:
            gen = torch.Generator().manual_seed(int(s))
            initial.append(self._initial(gen))
            demo_params.append(torch.rand(2, generator=gen))
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        for k in initial[0]:
            self.state[k][index] = torch.stack([x[k] for x in initial]).to(self.device)
        self.demo_params[index] = torch.stack(demo_params).to(self.device)
        self.elapsed[index] = 0

    def reset(self, seed: int | list[int] | None = None) -> torch.Tensor:
        """New episodes in every env: env ``i`` from ``seed + i`` (or ``seed[i]``; random seeds when None)."""
        if isinstance(seed, list) and len(seed) != self.num_envs:
            raise ValueError(f"a seed list needs {self.num_envs} entries (one per env), got {len(seed)}")
        if seed is None:
            seed = int(torch.randint(2**31 - self.num_envs, ()).item())
        seeds = seed if isinstance(seed, list) else [seed + i for i in range(self.num_envs)]
        self._reset_rows(list(range(self.num_envs)), seeds)
        self.task_flags = {}
        return self.obs()

    def reset_some(self, mask: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """Restart the envs where ``mask [N]`` is true, env ``i`` with ``seeds[i]``; returns obs ``[N, O]``."""
        mask = torch.as_tensor(mask, dtype=torch.bool).cpu()
        if mask.shape != (self.num_envs,) or len(seeds) != self.num_envs:
            raise ValueError(f"mask and seeds must have {self.num_envs} entries, got {tuple(mask.shape)} and {len(seeds)}")
        rows = torch.nonzero(mask).squeeze(1).tolist()
        if not rows:
            raise ValueError("reset_some needs at least one env to reset")
        self._reset_rows(rows, [seeds[i] for i in rows])
        return self.obs()

    def step(self, action: torch.Tensor):
        """``action [N, 2]`` in ``[-1, 1]`` (clipped) -> ``obs [N, O], reward [N], terminated [N], truncated [N],
        success [N]``; the task's other flags in ``self.task_flags``."""
        if action.shape != (self.num_envs, self.action_dim):
            raise ValueError(f"action must be [{self.num_envs}, {self.action_dim}], got {tuple(action.shape)}")
        if not torch.isfinite(action).all():
            raise ValueError(f"{self.env_id}: the action has NaN or inf entries")
        p_next = (self.state["p"] + MAX_STEP * action.to(self.device).clamp(-1, 1)).clamp(-1, 1)
        self.state.update(self._move(p_next))
        self.elapsed += 1
        success, reward, self.task_flags = self._evaluate()
        truncated = self.elapsed >= self.max_episode_steps
        return self.obs(), torch.where(success, 1.0, reward), success.clone(), truncated, success

    def snapshot(self) -> list:
        return [{k: v[i].clone() for k, v in (*self.state.items(), ("elapsed", self.elapsed),
                                              ("demo_params", self.demo_params))} for i in range(self.num_envs)]

    def restore(self, states: list) -> None:
        if len(states) != self.num_envs:
            raise ValueError(f"restore needs {self.num_envs} states (one per env), got {len(states)}")
        for key in (*self.state_keys, "elapsed", "demo_params"):
            target = self.elapsed if key == "elapsed" else self.demo_params if key == "demo_params" else self.state[key]
            target.copy_(torch.stack([s[key] for s in states]))

    def render(self, size: int = 128) -> np.ndarray:
        """Frames ``[N, size, size, 3]`` (uint8): the goal green, the disc blue, the agent red."""
        axis = torch.linspace(-1, 1, size, device=self.device)
        y, x = torch.meshgrid(-axis, axis, indexing="ij")
        grid = torch.stack([x, y], -1)[None]                                             # [1, S, S, 2]
        frame = torch.full((self.num_envs, size, size, 3), 255, dtype=torch.uint8, device=self.device)
        for key, radius, colour in self._drawn():
            inside = (grid - self.state[key][:, None, None]).norm(dim=-1) < radius       # [N, S, S]
            frame[inside] = torch.tensor(colour, dtype=torch.uint8, device=self.device)
        return frame.cpu().numpy()

    def _drawn(self):
        return [("g", 0.05, (60, 180, 75)), ("p", 0.04, (220, 50, 50))]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _uniform(generator: torch.Generator, low: float = -0.8, high: float = 0.8) -> torch.Tensor:
    return low + (high - low) * torch.rand(2, generator=generator)


class FastReach(FastVecEnv):
    env_id, obs_dim, default_episode_steps, state_keys = "FastReach-v0", 6, 40, ("p", "g")
    SUCCESS_RADIUS = 0.05

    def _initial(self, generator):
        return {"p": _uniform(generator), "g": _uniform(generator)}

    def _move(self, p_next):
        return {"p": p_next}

    def _evaluate(self):
        dist = (self.state["g"] - self.state["p"]).norm(dim=-1)
        return dist < self.SUCCESS_RADIUS, 1 - torch.tanh(3 * dist), {}

    def obs(self):
        p, g = self.state["p"], self.state["g"]
        return torch.cat([p, g, g - p], -1)


class FastPush(FastVecEnv):
    env_id, obs_dim, default_episode_steps, state_keys = "FastPush-v0", 10, 80, ("p", "c", "g")
    PUSHER_RADIUS, DISC_RADIUS, SUCCESS_RADIUS, NEAR_RADIUS = 0.05, 0.1, 0.03, 0.1
    FRICTION = 0.8  # the share of the pusher's motion across the contact normal that the disc takes along

    def _initial(self, generator):
        """The disc and goal apart; the pusher behind the disc (from the goal), 0.25-0.4 away and up to 0.2 to the
        side: an episode is mostly pushing, and what it tests is where the push ends."""
        while True:
            c, g = _uniform(generator, -0.5, 0.5), _uniform(generator, -0.6, 0.6)
            if (g - c).norm() > 0.3:
                break
        u = (g - c) / (g - c).norm()
        back, side = 0.25 + 0.15 * torch.rand((), generator=generator), 0.4 * torch.rand((), generator=generator) - 0.2
        p = (c - back * u + side * torch.stack([-u[1], u[0]])).clamp(-1, 1)
        return {"p": p, "c": c, "g": g}

    def _move(self, p_next):
        """The disc leaves the moved pusher along the contact normal, and takes FRICTION of the pusher's motion
        across it (a point on a disc without friction is an unstable push: it slides off any line)."""
        c, contact = self.state["c"], self.PUSHER_RADIUS + self.DISC_RADIUS
        offset = c - p_next
        dist = offset.norm(dim=-1, keepdim=True)
        touching = (dist < contact).squeeze(-1)
        normal = offset / dist.clamp(min=1e-6)
        moved = p_next - self.state["p"]
        across = moved - (moved * normal).sum(-1, keepdim=True) * normal
        pushed = p_next + contact * normal + self.FRICTION * across
        self._contact = touching
        return {"p": p_next, "c": torch.where(touching[:, None], pushed.clamp(-1, 1), c)}

    def behind(self) -> torch.Tensor:
        """``b [N, 2]``: the point behind the disc, opposite the goal, where a push towards the goal starts."""
        c, g = self.state["c"], self.state["g"]
        u = (g - c) / (g - c).norm(dim=-1, keepdim=True).clamp(min=1e-6)
        return c - (self.PUSHER_RADIUS + self.DISC_RADIUS + 0.02) * u

    def _evaluate(self):
        to_goal = (self.state["g"] - self.state["c"]).norm(dim=-1)
        reach = 1 - torch.tanh(5 * (self.behind() - self.state["p"]).norm(dim=-1))
        place = 1 - torch.tanh(5 * to_goal)
        flags = {"is_contact": self._contact.clone(), "is_obj_near": to_goal < self.NEAR_RADIUS}
        return to_goal < self.SUCCESS_RADIUS, (reach + 3 * place) / 4, flags

    def obs(self):
        p, c, g = self.state["p"], self.state["c"], self.state["g"]
        return torch.cat([p, c, g, c - p, g - c], -1)

    def _drawn(self):
        return [("g", 0.05, (60, 180, 75)), ("c", self.DISC_RADIUS, (40, 90, 220)), ("p", 0.05, (220, 50, 50))]


# The demonstrators' imperfections (module docstring): chosen so that the demos succeed in about 0.5-0.75 of episodes.
DEMO_REACH_SPEED = 0.55  # of MAX_STEP
DEMO_REACH_HEADING_ERROR = 0.6  # rad, the largest per-episode heading error
DEMO_PUSH_SPEED = 0.28  # of MAX_STEP, approaching and pushing
DEMO_PUSH_ANGLE_ERROR = 0.3  # rad, the largest per-episode error of the push direction
DEMO_PUSH_REACH = 0.04  # it pushes while the pusher is within this gap of the disc
DEMO_NOISE = 0.1  # std of the action noise (reach)
DEMO_PUSH_NOISE = 0.03  # std of the action noise (push: a clone that replays more loses the disc)


def demonstrate(env: FastVecEnv, generator: torch.Generator | None = None) -> torch.Tensor:
    """The scripted demonstrator's actions ``[N, 2]`` for the envs' current states (module docstring; a task of its
    own module brings its demonstrator as its ``demonstrate`` method, as ``flowlib.envs.fast_avoid`` does)."""
    if hasattr(env, "demonstrate"):
        return env.demonstrate(generator)
    noise = torch.randn(env.num_envs, 2, generator=generator).to(env.device)
    noise *= DEMO_PUSH_NOISE if isinstance(env, FastPush) else DEMO_NOISE
    err = 2 * env.demo_params[:, 0] - 1                                                  # [N] in [-1, 1]
    if isinstance(env, FastReach):
        to_goal = env.state["g"] - env.state["p"]
        heading = _rotate(to_goal, DEMO_REACH_HEADING_ERROR * err)
        step = DEMO_REACH_SPEED * heading / heading.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        close = to_goal.norm(dim=-1, keepdim=True) < DEMO_REACH_SPEED * MAX_STEP  # no overshoot at the goal
        action = torch.where(close, to_goal / MAX_STEP, step)
    elif isinstance(env, FastPush):
        p, c, g = env.state["p"], env.state["c"], env.state["g"]
        to_goal = (g - c).norm(dim=-1, keepdim=True)                                     # [N, 1]
        u = (g - c) / to_goal.clamp(min=1e-6)                                            # [N, 2] disc -> goal
        normal = (c - p) / (c - p).norm(dim=-1, keepdim=True).clamp(min=1e-6)             # [N, 2] pusher -> disc
        # push while touching (or nearly) from behind, within 60 degrees of the goal line
        pushing = ((c - p).norm(dim=-1) < env.PUSHER_RADIUS + env.DISC_RADIUS + DEMO_PUSH_REACH) & \
            ((normal * u).sum(-1) > 0.5)
        # otherwise go to the point behind the disc, around it while the pusher is on the goal's side
        across = torch.stack([-u[:, 1], u[:, 0]], -1)
        side = across * torch.sign(((p - c) * across).sum(-1, keepdim=True) + 1e-6)
        ahead = ((p - c) * u).sum(-1, keepdim=True) > -0.05
        waypoint = torch.where(ahead, c + 0.22 * side - 0.1 * u, env.behind())
        approach = (waypoint - p) / MAX_STEP
        approach = DEMO_PUSH_SPEED * approach / approach.norm(dim=-1, keepdim=True).clamp(min=1.0)
        # the push slows down as the disc nears the goal, so it stops there; its heading is off by a per-episode angle
        speed = torch.minimum(torch.full_like(to_goal, DEMO_PUSH_SPEED), to_goal / MAX_STEP)
        push = _rotate(u, DEMO_PUSH_ANGLE_ERROR * err) * speed
        action = torch.where(pushing[:, None], push, approach)
    else:
        raise ValueError(f"no demonstrator for {type(env).__name__}")
    return (action + noise).clamp(-1, 1)


def _rotate(v: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:  # [N, 2] by [N] radians
    cos, sin = torch.cos(angle), torch.sin(angle)
    return torch.stack([cos * v[:, 0] - sin * v[:, 1], sin * v[:, 0] + cos * v[:, 1]], -1)


# the registry moved to flowlib.envs.fast_tasks with the third task (2026-12-07): old imports still work, with a warning
__getattr__ = moved_names(__name__, {"FAST_TASKS": "flowlib.envs.fast_tasks"})
