"""Demonstrations with a view: the state demos rendered into a visual obs mode, and their training windows.

``replay_visual`` renders each frame of the state demos (``flowlib.envs.data.generate_demos``) by setting the env to the
simulator state the demo recorded at that step (``env_states``) in an env of the visual obs mode and reading its
observation (``flowlib.envs.visual``'s packed frame), so frames, states and actions line up exactly (no re-simulation that
could drift).  The file keeps, per episode, ``state [T+1, S]`` float32, the view (``rgb`` uint8, ``depth`` float16
metres, ``points`` float16), the state demo's full observation as ``privileged [T+1, O]`` (what an asymmetric critic
reads) and the actions / rewards / flags, chunked one frame per chunk and compressed, so ``VisualChunkDataset`` can
stream windows from disk (``in_memory=False``) instead of holding every frame.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from flowlib.envs.data import ChunkDataset, Episode, Normalizer, load_demos
from flowlib.envs.visual import ObsLayout, check_obs_mode, make_visual_env, pack
from flowlib.infra import progress


def visual_demo_path(state_demo_path: str | Path, obs_mode: str, camera_size: int, num_points: int) -> Path:
    """Where ``replay_visual`` caches the demos: ``..._<n>.rgb64...`` beside the state demos.  A point cloud is cut
    from any cached file of at least ``num_points`` points (``..._<n>.pointcloud<P>...``; ``VisualChunkDataset``)."""
    path = Path(state_demo_path)
    if obs_mode == "pointcloud":
        pattern = path.name.replace(".state.", ".pointcloud*.")
        cached = sorted((int(p.name.split(".pointcloud")[1].split(".")[0]), p) for p in path.parent.glob(pattern))
        for points, found in cached:
            if points >= num_points and not found.name.startswith("."):
                return found
    view = f"{obs_mode}{num_points}" if obs_mode == "pointcloud" else f"{obs_mode}{camera_size}"
    return path.with_name(path.name.replace(".state.", f".{view}."))


def replay_visual(state_demo_path: str | Path, obs_mode: str = "rgb", camera_size: int = 64, num_points: int = 512,
                  max_episodes: int | None = None, out_path: str | Path | None = None, force: bool = False) -> Path:
    """Render the state demos at ``state_demo_path`` into ``obs_mode`` (module docstring); returns the ``.h5``.

    Each frame: the env is set to the demo's recorded simulator state (``set_state_dict``) and observed, so frame
    ``t`` shows the state whose observation is the state demo's ``obs[t]``.  Cached by name beside the state demos
    (``..._<n>.<mode><size>.<control>...h5``); written atomically; ``force`` renders again."""
    import h5py

    check_obs_mode(obs_mode)
    if obs_mode == "state":
        raise ValueError("obs_mode 'state' needs no rendering: load the state demos (flowlib.envs.data.load_demos)")
    state_demo_path = Path(state_demo_path)
    out = Path(out_path) if out_path else visual_demo_path(state_demo_path, obs_mode, camera_size, num_points)
    if out.is_file() and not force:
        return out
    meta = json.loads(state_demo_path.with_suffix(".json").read_text())
    env_id, control_mode = meta["env_info"]["env_id"], meta["env_info"]["env_kwargs"]["control_mode"]
    episodes = load_demos(state_demo_path, control_mode=control_mode, max_episodes=max_episodes)
    env = make_visual_env(env_id, obs_mode, camera_size, num_points, control_mode, sim_backend="physx_cpu",
                          render_backend="sapien_cpu")
    base, layout = env.unwrapped, env.layout
    tmp = out.with_name(f".{out.name}.tmp")
    t0 = time.time()
    bar = progress.bar(sum(len(ep) + 1 for ep in episodes), f"rendering {len(episodes)} demos ({obs_mode})",
                       unit="frame")
    with h5py.File(state_demo_path, "r") as src, h5py.File(tmp, "w") as f:
        keys = sorted((k for k in src.keys() if k.startswith("traj_")), key=lambda k: int(k.split("_")[1]))
        for key, ep in zip(keys, episodes):
            env.reset(seed=ep.seed)
            states = _env_states(src[key]["env_states"])
            frames = []
            for t in range(len(ep) + 1):
                base.set_state_dict({k: _at(v, t) for k, v in states.items()})
                frames.append(pack(base.get_obs(), obs_mode, num_points)[0])
                bar.update()
            packed = torch.stack(frames)  # [T+1, S + V]
            state, view = layout.split(packed)
            g = f.create_group(key)
            g.create_dataset("state", data=state.numpy().astype(np.float32))
            _write_view(g, obs_mode, view.numpy())
            g.create_dataset("privileged", data=ep.obs)
            for name in ("actions", "rewards", "success", "terminated", "truncated"):
                g.create_dataset(name, data=getattr(ep, name))
            g.attrs["seed"] = -1 if ep.seed is None else ep.seed
        f.attrs["layout"] = json.dumps(layout.to_dict())
        f.attrs["env_id"], f.attrs["control_mode"] = env_id, control_mode
        f.attrs["camera_size"], f.attrs["num_points"] = camera_size, num_points
        f.attrs["source"] = str(state_demo_path)
    bar.close()
    env.close()
    tmp.replace(out)
    progress.say(f"rendered {len(episodes)} demos into {obs_mode} in {time.time() - t0:.0f} s: {out}")
    return out


def _env_states(group) -> dict:
    import h5py

    return {k: (_env_states(v) if isinstance(v, h5py.Group) else np.asarray(v)) for k, v in group.items()}


def _at(tree, t: int):
    if isinstance(tree, dict):
        return {k: _at(v, t) for k, v in tree.items()}
    return torch.from_numpy(tree[t:t + 1])


def _write_view(g, mode: str, view: np.ndarray) -> None:
    """The view stored compactly: uint8 colour, float16 depth (m) and points (m), one frame per chunk."""
    def put(name, data):
        g.create_dataset(name, data=data, chunks=(1, *data.shape[1:]), compression="lzf")
    if mode == "pointcloud":
        put("points", view.astype(np.float16))
        return
    put("rgb", np.clip(np.rint(view[..., :3]), 0, 255).astype(np.uint8))
    if mode == "rgbd":
        put("depth", view[..., 3:].astype(np.float16))


def read_view(g, mode: str, frames=slice(None), num_points: int | None = None) -> np.ndarray:
    """Frames of an episode group's view as float32 ``[T', *view_shape]`` (the packed units); a point cloud's first
    ``num_points`` points (farthest-point sampling is greedy: its first ``P`` points are its ``P``-point sample)."""
    if mode == "pointcloud":
        return np.asarray(g["points"][frames, :num_points], dtype=np.float32)
    rgb = np.asarray(g["rgb"][frames], dtype=np.float32)
    if mode == "rgbd":
        return np.concatenate([rgb, np.asarray(g["depth"][frames], dtype=np.float32)], -1)
    return rgb


COLOUR_SHIFT = COLOUR_SCALE = 127.5  # colour 0-255 -> [-1, 1]


def packed_normalizer(state_normalizer, layout: ObsLayout):
    """A ``flowlib.envs.data.Normalizer`` over packed frames: the state dims by ``state_normalizer`` (fitted on the demos),
    the view dims by fixed constants, not fitted: colour to ``[-1, 1]``, depth and points left in metres.  So every
    view value stays within the agents' ``obs_clip`` (5) and a frame normalises the same whatever the demos."""
    norm = Normalizer(layout.dim, state_normalizer.mode)
    norm.shift[:layout.state_dim] = state_normalizer.shift
    norm.scale[:layout.state_dim] = state_normalizer.scale
    if layout.mode in ("rgb", "rgbd"):
        colour = torch.zeros(layout.view_shape, dtype=torch.bool)
        colour[..., :3] = True
        view = slice(layout.state_dim, None)
        norm.shift[view] = torch.where(colour.reshape(-1), COLOUR_SHIFT, 0.0)
        norm.scale[view] = torch.where(colour.reshape(-1), COLOUR_SCALE, 1.0)
    return norm


class VisualChunkDataset:
    """``flowlib.envs.data.ChunkDataset``'s (observation window, action chunk) pairs over visual demos (``replay_visual``'s
    file): the same windows and padding (it is a ``ChunkDataset`` over the episodes' states and actions), with each
    window's packed frames ``[To, S + V]`` built when a batch asks for it.  ``in_memory``: the views are read once
    (uint8 colour: ~12 kB a 64 x 64 frame); otherwise each batch reads its frames from the file.
    ``batch(idx, obs_normalizer, action_normalizer)`` -> normalised ``obs [B, To, S + V]``, ``actions [B, H, A]``."""

    def __init__(self, path: str | Path, obs_horizon: int = 2, pred_horizon: int = 16, max_episodes: int | None = None,
                 in_memory: bool = True, action_norm: str = "minmax", obs_normalizer=None, action_normalizer=None,
                 num_points: int | None = None):
        import h5py

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"visual demo file {self.path} not found: render one with "
                                    "flowlib.envs.visual_demos.replay_visual(state_demo_path, obs_mode)")
        self.file = h5py.File(self.path, "r")
        self.layout = ObsLayout.from_dict(json.loads(self.file.attrs["layout"]))
        self.env_id, self.control_mode = str(self.file.attrs["env_id"]), str(self.file.attrs["control_mode"])
        self.camera_size, self.num_points = int(self.file.attrs["camera_size"]), int(self.file.attrs["num_points"])
        if self.layout.mode == "pointcloud" and num_points is not None and num_points != self.num_points:
            if num_points > self.num_points:
                raise ValueError(f"{self.path.name} holds {self.num_points} points a frame, {num_points} asked: render "
                                 f"the demos with num_points={num_points} (flowlib.envs.visual_demos.replay_visual)")
            self.num_points = num_points  # the first num_points of a farthest-point sample are its num_points sample
            self.layout = ObsLayout("pointcloud", self.layout.state_dim, (num_points, 3))
        keys = sorted((k for k in self.file.keys() if k.startswith("traj_")), key=lambda k: int(k.split("_")[1]))
        self.groups = [self.file[k] for k in keys[:max_episodes]]
        episodes = [Episode(obs=np.asarray(g["state"], dtype=np.float32), actions=np.asarray(g["actions"]),
                            rewards=np.asarray(g["rewards"]), success=np.asarray(g["success"]),
                            terminated=np.asarray(g["terminated"]), truncated=np.asarray(g["truncated"]),
                            seed=None if int(g.attrs["seed"]) < 0 else int(g.attrs["seed"])) for g in self.groups]
        self.states = ChunkDataset(episodes, obs_horizon, pred_horizon, action_norm=action_norm,
                                   action_normalizer=action_normalizer)
        self.obs_horizon, self.pred_horizon, self.episodes = obs_horizon, pred_horizon, episodes
        self.index = self.states.index
        self.obs_normalizer = (packed_normalizer(self.states.obs_normalizer, self.layout)
                               if obs_normalizer is None else obs_normalizer)
        self.action_normalizer = self.states.action_normalizer
        self.views = [read_view(g, self.layout.mode, num_points=self.num_points) for g in self.groups] if in_memory else None

    @property
    def obs_dim(self) -> int:
        return self.layout.dim

    @property
    def action_dim(self) -> int:
        return self.states.action_dim

    def __len__(self) -> int:
        return len(self.index)

    def privileged(self, e: int) -> np.ndarray:
        """Episode ``e``'s full state observations ``[T+1, O]`` (what an asymmetric critic reads)."""
        return np.asarray(self.groups[e]["privileged"], dtype=np.float32)

    def window(self, e: int, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw packed ``obs [To, S + V]`` and ``actions [H, A]`` starting at step ``s`` of episode ``e``."""
        state, actions = self.states.window(e, s)
        frames = np.clip(np.arange(s, s + self.obs_horizon), 0, len(self.episodes[e]))
        if self.views is not None:
            view = self.views[e][frames]
        else:  # h5py reads increasing indices: read the distinct frames, then repeat the padded ones
            distinct = np.unique(frames)
            view = read_view(self.groups[e], self.layout.mode, distinct.tolist(),
                             self.num_points)[np.searchsorted(distinct, frames)]
        return np.concatenate([state, view.reshape(len(frames), -1)], -1), actions

    def batch(self, idx, obs_normalizer=None, action_normalizer=None) -> tuple[torch.Tensor, torch.Tensor]:
        windows = [self.window(*self.index[int(i)]) for i in idx]
        obs = torch.from_numpy(np.stack([w[0] for w in windows]))          # [B, To, S + V]
        actions = torch.from_numpy(np.stack([w[1] for w in windows]))      # [B, H, A]
        on, an = obs_normalizer or self.obs_normalizer, action_normalizer or self.action_normalizer
        with torch.no_grad():
            return on.normalize(obs.to(on.shift.device)), an.normalize(actions.to(an.shift.device))
