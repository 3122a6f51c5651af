"""Seeing the scene: RGB(-D) images and point clouds as observations, from the env and from the demonstrations.

**One packed vector per frame.**  Every seam of flowlib carries observations as ``[B, To, O]`` float tensors
(evaluation, rollouts, replay buffers, stage 3's agents).  A visual observation travels the same way, packed as
``[state S | view V]``: ``S`` is what the robot knows of itself and of the task's goal, ``V`` the camera's view
flattened (``ObsLayout``).  Only the policy's ``obs_encoder`` (``flowlib.policies.encoders``) unpacks it, so no other module
changes for pixels, and a stage-3 agent on a visual policy is the same agent.  Pixels stay in their raw units
(0-255 colour, depth in metres, points in metres); the observation normaliser maps colour to ``[-1, 1]`` by fixed
constants and leaves metres as they are (``flowlib.envs.visual_demos.packed_normalizer``).

* ``rgb``: ``(H, W, 3)`` colour of ManiSkill's task camera (``base_camera``), ``camera_size`` pixels square;
* ``rgbd``: ``(H, W, 4)``, colour plus depth in metres;
* ``pointcloud``: ``(P, 3)`` points in the world frame, ``P = num_points``: the camera's points above the table
  (``z > POINTCLOUD_MIN_Z``, which crops the table and the floor), down-sampled by farthest-point sampling from
  the first point (deterministic), as DP3 (Ze et al. 2024, Sec. 3.1) crops and down-samples.

The **state** part is ManiSkill's state entries of the visual obs mode (the robot's ``qpos``, ``qvel``, its TCP pose
and the goal the camera cannot see, e.g. PickCube's ``goal_pos``), less the contact-derived true/false entries
(PickCube's ``is_grasped``): a ``physx_cpu`` reset leaves them stale (``flowlib.envs``) and a replay that sets the
simulator's state frame by frame cannot compute them.  No object pose: that is what the camera is for.

**Privileged state.**  Each step's and reset's ``info["privileged_state"]`` is ManiSkill's full state observation of
the same simulator state (what ``obs_mode="state"`` returns, the object's pose included: ``privileged_state``), for a
critic that reads the state while the policy reads the camera (``flowlib.rl.asymmetric``).

**Demonstrations** with a view: ``flowlib.envs.visual_demos`` (rendered from the state demos' recorded simulator states).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

OBS_MODES = ("state", "rgb", "rgbd", "pointcloud")
VISUAL_MODES = OBS_MODES[1:]
POINTCLOUD_MIN_Z = 0.005  # metres above the table top (z = 0 in ManiSkill's table scenes): the table and floor go
CAMERA = "base_camera"    # ManiSkill's task camera; the tasks here have one


@dataclass(frozen=True)
class ObsLayout:
    """How one packed frame ``[S + V]`` splits: ``state [S]`` and the view ``[*view_shape]`` (module docstring)."""

    mode: str
    state_dim: int
    view_shape: tuple[int, ...]

    def __post_init__(self):
        if self.mode not in VISUAL_MODES:
            raise ValueError(f"a packed layout is for the visual obs modes {VISUAL_MODES}, got {self.mode!r}")
        object.__setattr__(self, "view_shape", tuple(int(n) for n in self.view_shape))

    @property
    def view_dim(self) -> int:
        return int(np.prod(self.view_shape))

    @property
    def dim(self) -> int:
        return self.state_dim + self.view_dim

    def split(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``obs [..., S + V]`` -> ``state [..., S]``, ``view [..., *view_shape]``."""
        if obs.shape[-1] != self.dim:
            raise ValueError(f"a packed {self.mode} frame has {self.dim} values ({self.state_dim} state + "
                             f"{self.view_shape} view), got {obs.shape[-1]}")
        return obs[..., :self.state_dim], obs[..., self.state_dim:].reshape(*obs.shape[:-1], *self.view_shape)

    def to_dict(self) -> dict:
        return {**asdict(self), "view_shape": list(self.view_shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "ObsLayout":
        return cls(d["mode"], d["state_dim"], tuple(d["view_shape"]))


def check_obs_mode(obs_mode: str) -> str:
    if obs_mode not in OBS_MODES:
        raise ValueError(f"obs_mode must be one of {OBS_MODES}, got {obs_mode!r}")
    return obs_mode


def env_kwargs(obs_mode: str, camera_size: int, num_points: int) -> dict:
    """The ``gym.make`` keywords of a visual obs mode: ManiSkill's mode and the camera's size."""
    return {"obs_mode": check_obs_mode(obs_mode), "sensor_configs": {"width": camera_size, "height": camera_size}}


def policy_env_kwargs(meta: dict) -> dict:
    """What ``flowlib.envs.maniskill.make_env`` needs to give a policy (its checkpoint ``meta``) the observations it was
    trained on: ``{}`` for a state policy."""
    if meta.get("obs_mode", "state") == "state":
        return {}
    return {"obs_mode": meta["obs_mode"], "camera_size": meta["camera_size"], "num_points": meta["num_points"]}


# ---------------------------------------------------------------------------------------------------------------
# From ManiSkill's observation dict to a packed frame
# ---------------------------------------------------------------------------------------------------------------

def state_part(obs: dict) -> torch.Tensor:
    """``[N, S]``: the dict's ``agent`` and ``extra`` entries flattened in ManiSkill's order, less true/false ones."""
    parts = []
    for group in ("agent", "extra"):
        for value in obs.get(group, {}).values():
            if value.dtype == torch.bool:
                continue  # contact-derived flags (module docstring)
            parts.append(value.float().reshape(value.shape[0], -1))
    return torch.cat(parts, -1)


def farthest_point_sample(xyz: torch.Tensor, num_points: int) -> torch.Tensor:
    """Indices ``[num_points]`` of ``xyz [M, 3]`` by farthest-point sampling from point 0 (Qi et al. 2017, PointNet++
    Sec. 3.2): each next point is the one farthest from those chosen.  Fewer than ``num_points`` points: all of them,
    the last repeated."""
    M = xyz.shape[0]
    if M <= num_points:
        return torch.cat([torch.arange(M), torch.full((num_points - M,), max(M - 1, 0))])
    chosen = torch.zeros(num_points, dtype=torch.long)
    dist = torch.full((M,), float("inf"))
    for i in range(1, num_points):
        dist = torch.minimum(dist, (xyz - xyz[chosen[i - 1]]).square().sum(-1))
        chosen[i] = dist.argmax()
    return chosen


def view_part(obs: dict, mode: str, num_points: int) -> torch.Tensor:
    """``[N, *view_shape]`` float: colour 0-255 (+ depth in metres), or ``num_points`` cropped, sampled points."""
    if mode == "pointcloud":
        xyzw = obs["pointcloud"]["xyzw"].float()  # [N, M, 4]; w = 0 marks no point
        views = []
        for cloud in xyzw:
            keep = (cloud[:, 3] > 0) & (cloud[:, 2] > POINTCLOUD_MIN_Z)
            xyz = cloud[keep, :3]
            if len(xyz) == 0:
                xyz = torch.zeros(1, 3)  # nothing above the table in view: one point at the origin
            views.append(xyz[farthest_point_sample(xyz, num_points)])
        return torch.stack(views)  # [N, P, 3]
    camera = obs["sensor_data"][CAMERA]
    channels = [camera["rgb"].float()]  # [N, H, W, 3], 0-255
    if mode == "rgbd":
        channels.append(camera["depth"].float() / 1000.0)  # [N, H, W, 1]; ManiSkill's depth is in mm
    return torch.cat(channels, -1)


def pack(obs: dict, mode: str, num_points: int) -> torch.Tensor:
    """ManiSkill's batched visual observation dict -> packed frames ``[N, S + V]`` (module docstring)."""
    state, view = state_part(obs), view_part(obs, mode, num_points)
    return torch.cat([state, view.reshape(view.shape[0], -1)], -1)


def layout_of(obs: dict, mode: str, num_points: int) -> ObsLayout:
    return ObsLayout(mode, state_part(obs).shape[-1], tuple(view_part(obs, mode, num_points).shape[1:]))


def privileged_state(base, info: dict | None = None) -> torch.Tensor:
    """``[N, P]``: ManiSkill's state observation (``obs_mode="state"``'s flat vector) of the simulator's present state,
    read from a ManiSkill env ``base`` of any obs mode.  A task adds the object's pose to its observation only when its
    obs mode names ``state`` (``_get_obs_extra``), so the mode is set to ``"state"`` for the one call; ``info``: the
    step's evaluation (``get_info()`` when None)."""
    mode = base._obs_mode
    base._obs_mode = "state"
    try:
        return base.get_obs(info)
    finally:
        base._obs_mode = mode


def packed_observation_wrapper():
    """``PackedObservation(env, mode, num_points)``: a gymnasium observation wrapper around a ManiSkill env (batched
    torch dicts in, packed ``[N, S + V]`` out), applied before ``CPUGymWrapper``; its ``layout`` says how to split,
    ``state_dim`` how wide the ``info["privileged_state"]`` is that each step and reset add (module docstring)."""
    import gymnasium as gym

    class PackedObservation(gym.ObservationWrapper):
        def __init__(self, env, mode: str, num_points: int):
            super().__init__(env)
            self.mode, self.num_points = mode, num_points
            base = env.unwrapped
            self.layout = layout_of(base._init_raw_obs, mode, num_points)
            self.state_dim = int(privileged_state(base).shape[-1])
            base.update_obs_space(self.observation(base._init_raw_obs))

        def observation(self, obs):
            return pack(obs, self.mode, self.num_points)

        def reset(self, **kwargs):
            obs, info = super().reset(**kwargs)
            return obs, {**info, "privileged_state": privileged_state(self.env.unwrapped)}

        def step(self, action):
            obs, reward, terminated, truncated, info = super().step(action)
            info["privileged_state"] = privileged_state(self.env.unwrapped, info)
            return obs, reward, terminated, truncated, info

    return PackedObservation


def make_visual_env(env_id: str, obs_mode: str, camera_size: int, num_points: int, control_mode: str, **kwargs):
    """One ManiSkill env of a visual obs mode whose observations are packed frames (``PackedObservation``)."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    env = gym.make(env_id, control_mode=control_mode, **env_kwargs(obs_mode, camera_size, num_points), **kwargs)
    return packed_observation_wrapper()(env, obs_mode, num_points)


# ---------------------------------------------------------------------------------------------------------------
# Augmentation
# ---------------------------------------------------------------------------------------------------------------

def random_shift(view: torch.Tensor, pad: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """DrQ's image augmentation (Kostrikov et al. 2021, Sec. 3.1; Yarats et al. 2022): pad each image by ``pad``
    pixels (edge replicated) and crop it back at a random integer offset.  ``view [B, To, H, W, C]``; a sample's
    frames share one shift (the window is one observation).  ``pad = 0``: unchanged."""
    if pad == 0:
        return view
    B, To, H, W, C = view.shape
    x = view.permute(0, 1, 4, 2, 3).reshape(B, To * C, H, W)
    x = torch.nn.functional.pad(x, (pad,) * 4, mode="replicate")
    dx, dy = torch.randint(0, 2 * pad + 1, (2, B), generator=generator)
    rows = (torch.arange(H)[None, :] + dy[:, None]).to(view.device)  # [B, H]
    cols = (torch.arange(W)[None, :] + dx[:, None]).to(view.device)  # [B, W]
    x = x[torch.arange(B)[:, None, None], :, rows[:, :, None], cols[:, None, :]]  # [B, H, W, To*C]
    return x.reshape(B, H, W, To, C).permute(0, 3, 1, 2, 4)


def augment_window(obs: torch.Tensor, layout: ObsLayout, pad: int) -> torch.Tensor:
    """Packed windows ``obs [B, To, S + V]`` with each sample's images shifted (``random_shift``); point clouds, and
    ``pad = 0``, unchanged."""
    if pad == 0 or layout.mode == "pointcloud":
        return obs
    state, view = layout.split(obs)  # [B, To, S], [B, To, H, W, C]
    return torch.cat([state, random_shift(view, pad).reshape(*obs.shape[:2], -1)], -1)
