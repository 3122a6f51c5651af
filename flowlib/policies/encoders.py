"""Observation encoders: what a velocity net's ``obs_encoder`` is for pixels and points (``flowlib.envs.visual``).

Every encoder maps the flattened, normalised observation window ``[B, To * O]`` to ``[B, obs_emb_dim]``, the
interface of the state policy's MLP ``obs_encoder`` (``flowlib.flows.unet``), so the velocity nets, stage 3's
``freeze_obs_encoder`` and the checkpoints treat them alike.  A visual window is ``To`` packed frames
``[state S | view V]`` (``flowlib.envs.visual.ObsLayout``); each frame's view goes through a shared per-frame encoder
to ``feature_dim`` features, is joined with its state, and the ``To`` frames' ``[feature | state]`` go through one
linear layer + Mish to ``obs_emb_dim`` (Diffusion Policy's per-frame image features, concatenated over the window).

* ``SpatialSoftmaxCNN`` (RGB / RGB-D): four 3x3 convolutions (the first two of stride 2), then a spatial soft-argmax per channel (Levine et al.
  2016, "End-to-end training of deep visuomotor policies", Sec. 4.1; Diffusion Policy replaces ResNet's global pool
  with it): each channel becomes the expected image position ``(x, y)`` of its softmax over pixels, a keypoint.
  Its softmax maps are what the encoder attends to (``attention``).  Colour arrives in ``[-1, 1]``
  (``flowlib.envs.visual.packed_normalizer``), depth in metres, clipped here to 2 m and mapped to ``[-1, 1]``.  Random-shift augmentation is applied to the batch before it, in training
  only (``flowlib.envs.visual.random_shift``), so the encoder itself is deterministic (stage 3's ratios stay exact).
* ``PointNetEncoder`` (point clouds): DP3's encoder (Ze et al. 2024, "3D Diffusion Policy", Sec. 3.1): a per-point
  MLP 3 -> 64 -> 128 -> 256 with LayerNorm + ReLU, max-pooled over the points, projected to ``feature_dim`` and
  LayerNorm-ed.

A pretrained image encoder (a ResNet-18, a ViT) goes behind the same seam: a module with ``feature_dim`` outputs
per frame in place of ``SpatialSoftmaxCNN`` (docs/howto/visual_observations.md).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from flowlib.envs.visual import ObsLayout

DEPTH_CLIP = 2.0  # metres: beyond, depth says "far" (the floor past the table)


class SpatialSoftmax(nn.Module):
    """``[N, C, H, W]`` feature maps -> ``[N, 2C]`` expected ``(x, y)`` per channel in ``[-1, 1]`` (soft-argmax)."""

    def forward(self, x, return_maps: bool = False):
        N, C, H, W = x.shape
        maps = torch.softmax(x.reshape(N, C, H * W), -1)  # [N, C, H*W]
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, H, device=x.device), torch.linspace(-1, 1, W, device=x.device),
                                indexing="ij")
        keypoints = torch.stack([(maps * xs.reshape(-1)).sum(-1), (maps * ys.reshape(-1)).sum(-1)], -1)  # [N, C, 2]
        keypoints = keypoints.reshape(N, 2 * C)
        return (keypoints, maps.reshape(N, C, H, W)) if return_maps else keypoints


class SpatialSoftmaxCNN(nn.Module):
    """Per-frame image encoder: normalised ``[N, H, W, C]`` (colour, optional depth) -> ``[N, feature_dim]``."""

    def __init__(self, in_channels: int, feature_dim: int = 64, channels: int = 32, keypoints: int = 32):
        super().__init__()
        self.in_channels = in_channels
        self.convs = nn.Sequential(  # two halvings first: a 64 x 64 frame costs ~6M multiply-adds
            nn.Conv2d(in_channels, channels // 2, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(channels // 2, channels, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=1, padding=1), nn.ReLU(),
            nn.Conv2d(channels, keypoints, 3, stride=1, padding=1))
        self.softmax = SpatialSoftmax()
        self.head = nn.Sequential(nn.Linear(2 * keypoints, feature_dim), nn.LayerNorm(feature_dim))

    def scale(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised ``[N, H, W, C]`` (colour in ``[-1, 1]``, depth in metres) -> ``[N, C, H, W]``, depth clipped
        to 2 m and mapped to ``[-1, 1]``."""
        x = images.permute(0, 3, 1, 2)
        if self.in_channels == 3:
            return x
        return torch.cat([x[:, :3], x[:, 3:].clamp(0, DEPTH_CLIP) * (2 / DEPTH_CLIP) - 1], 1)

    def forward(self, images: torch.Tensor, return_maps: bool = False):
        keypoints, maps = self.softmax(self.convs(self.scale(images)), return_maps=True)
        features = self.head(keypoints)
        return (features, maps) if return_maps else features


class PointNetEncoder(nn.Module):
    """Per-frame point-cloud encoder (DP3's): ``[N, P, 3]`` points (m) -> ``[N, feature_dim]``."""

    def __init__(self, feature_dim: int = 64, widths: tuple[int, ...] = (64, 128, 256)):
        super().__init__()
        layers, c_in = [], 3
        for c_out in widths:
            layers += [nn.Linear(c_in, c_out), nn.LayerNorm(c_out), nn.ReLU()]
            c_in = c_out
        self.point_mlp = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(c_in, feature_dim), nn.LayerNorm(feature_dim))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.head(self.point_mlp(points).max(dim=1).values)  # max over points: order does not matter


class VisualObsEncoder(nn.Module):
    """``[B, To * (S + V)]`` packed, normalised window -> ``[B, obs_emb_dim]`` (module docstring)."""

    def __init__(self, layout: ObsLayout, obs_horizon: int, obs_emb_dim: int, feature_dim: int = 64):
        super().__init__()
        self.layout, self.obs_horizon = layout, obs_horizon
        if layout.mode == "pointcloud":
            self.view_encoder = PointNetEncoder(feature_dim)
        else:
            self.view_encoder = SpatialSoftmaxCNN(layout.view_shape[-1], feature_dim)
        self.fuse = nn.Sequential(nn.Linear(obs_horizon * (feature_dim + layout.state_dim), obs_emb_dim), nn.Mish())

    def frames(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, To * (S + V)]`` -> states ``[B * To, S]`` and views ``[B * To, *view_shape]``."""
        B = obs.shape[0]
        if obs.shape[1:] != (self.obs_horizon * self.layout.dim,):
            raise ValueError(f"the visual encoder reads [B, {self.obs_horizon} * {self.layout.dim}] packed windows "
                             f"({self.layout.mode}), got {tuple(obs.shape)}: make the env with the policy's "
                             f"obs_mode (flowlib.envs.visual.policy_env_kwargs)")
        return self.layout.split(obs.reshape(B * self.obs_horizon, self.layout.dim))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        B = obs.shape[0]
        state, view = self.frames(obs)
        features = self.view_encoder(view)  # [B * To, feature_dim]
        return self.fuse(torch.cat([features, state], -1).reshape(B, -1))

    @torch.no_grad()
    def attention(self, obs: torch.Tensor) -> torch.Tensor:
        """The CNN's softmax maps of each frame, ``[B * To, keypoints, H', W']``: where each keypoint looks."""
        if not isinstance(self.view_encoder, SpatialSoftmaxCNN):
            raise ValueError("attention maps are the image encoder's; a point-cloud encoder max-pools over points")
        _, view = self.frames(obs)
        return self.view_encoder(view, return_maps=True)[1]


def build_obs_encoder(meta: dict) -> nn.Module | None:
    """The ``obs_encoder`` a checkpoint's ``meta`` describes: a visual one for a visual ``obs_mode``, else ``None``
    (the velocity net then builds its MLP encoder when ``obs_emb_dim > 0``)."""
    if meta.get("obs_mode", "state") == "state":
        return None
    if not meta["obs_emb_dim"]:
        raise ValueError(f"a {meta['obs_mode']} policy needs an obs_encoder: set obs_emb_dim > 0 (e.g. 64)")
    return VisualObsEncoder(ObsLayout.from_dict(meta["obs_layout"]), meta["obs_horizon"], meta["obs_emb_dim"],
                            meta.get("view_feature_dim", 64))
