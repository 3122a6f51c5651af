"""Velocity networks with the flowlib interface ``net(x, t, d, obs) -> [B, ...]``.

``t`` is the flow time (``[B]``, 0 = noise), ``d`` the jump the caller will take (``[B]``; see
``flowlib.flows``), ``obs`` an optional observation (``[B, ...]``, flattened) or ``None``.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn


class SinusoidalEmbedding(nn.Module):
    """Transformer-style sinusoidal features of a scalar in [0, 1] (Vaswani et al. 2017, Sec. 3.5).

    The scalar is scaled by ``scale`` (1000, as in DDPM-style time embeddings) before the
    geometric frequency bank, so differences of 1/128 in ``t`` or ``d`` are well resolved.
    """

    def __init__(self, dim: int, scale: float = 1000.0, max_period: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"embedding dim must be even, got {dim}")
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half) / half)
        self.register_buffer("freqs", freqs, persistent=False)
        self.scale = scale

    def forward(self, s: torch.Tensor) -> torch.Tensor:  # [B] -> [B, dim]
        args = (self.scale * s)[:, None] * self.freqs[None]
        return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


def mlp(sizes: list[int], act=nn.SiLU) -> nn.Sequential:
    """Linear layers of the given sizes with ``act`` between them (none after the last)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


@contextlib.contextmanager
def frozen(module: nn.Module):
    """Inside, ``module``'s parameters take no gradient while gradients still flow through it to its inputs: a
    graph built here has no weight-gradient nodes for them (an actor's loss through a critic computes ``dQ/da``
    only).  Their ``requires_grad`` flags are restored on exit."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield module
    finally:
        for p in params:
            p.requires_grad_(True)


class ConditionalMLP(nn.Module):
    """MLP velocity net for flat samples: ``[B, D]`` (or any ``[B, ...]`` of ``D`` elements).

    Input: the sample, sinusoidal embeddings of ``t`` and ``d``, and the flattened observation,
    concatenated; output has the sample's shape.  Usable by ReFlow, MeanFlow and ShortCut alike.
    """

    def __init__(self, dim: int, obs_dim: int = 0, hidden: int = 256, depth: int = 3, emb_dim: int = 64,
                 emb_scale: float = 1000.0):
        super().__init__()
        self.dim, self.obs_dim = dim, obs_dim
        self.t_emb = SinusoidalEmbedding(emb_dim, scale=emb_scale)
        self.d_emb = SinusoidalEmbedding(emb_dim, scale=emb_scale)
        self.body = mlp([dim + 2 * emb_dim + obs_dim] + [hidden] * depth + [dim])

    def forward(self, x, t, d, obs=None):
        B = x.shape[0]
        parts = [x.reshape(B, -1), self.t_emb(t), self.d_emb(d)]
        if self.obs_dim:
            if obs is None:
                raise ValueError(f"this net was built with obs_dim={self.obs_dim}: pass obs")
            parts.append(obs.reshape(B, -1))
        elif obs is not None:
            raise ValueError("this net was built with obs_dim=0 but got obs: build it with obs_dim set")
        return self.body(torch.cat(parts, dim=-1)).reshape(x.shape)


def q_mlp(sizes: list[int]) -> nn.Sequential:
    """Linear -> LayerNorm -> ReLU blocks, then a linear head: LayerNorm keeps Q stable at a high update-to-data
    ratio (Ball et al. 2023, RLPD); ReLU because Mish costs a third of an update on a CPU."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 2):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.LayerNorm(sizes[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(sizes[-2], sizes[-1]))


class TwinQ(nn.Module):
    """``Q_1, Q_2 (o, w)``: ``[B, To*O]`` normalised observation window, ``[B, D]`` latent -> ``[2, B]``."""

    def __init__(self, obs_in: int, latent_dim: int, hidden: tuple[int, ...] = (256, 256)):
        super().__init__()
        self.nets = nn.ModuleList(q_mlp([obs_in + latent_dim, *hidden, 1]) for _ in range(2))

    def forward(self, o_flat: torch.Tensor, w_flat: torch.Tensor) -> torch.Tensor:
        x = torch.cat([o_flat, w_flat], 1)
        return torch.stack([net(x).squeeze(-1) for net in self.nets])

    def q1(self, o_flat: torch.Tensor, w_flat: torch.Tensor) -> torch.Tensor:
        """``Q_1 (o, w)`` alone ``[B]``: what TD3's deterministic policy gradient follows (Fujimoto et al. 2018,
        Alg. 1), without ``Q_2``'s forward and backward."""
        return self.nets[0](torch.cat([o_flat, w_flat], 1)).squeeze(-1)


# --------------------------------------------------------------------------- ReinFlow's noise net (flowlib.methods.reinflow_agent)


class ExploreNoiseNet(nn.Module):
    """``(t_k, obs window) -> noise_std [B, A]`` in ``[min_noise_std, max_noise_std]`` (ReinFlow, Sec. 4.2).

    ``min + (max - min) * sigmoid(mlp([emb(t), obs]))``: bounded below so the chain stays
    stochastic (log-probs stay finite), above so exploration stays near the data.  ``max_noise_std``
    is a buffer that the noise schedule lowers during training.
    """

    def __init__(self, obs_in: int, action_dim: int, min_noise_std: float = 0.01, max_noise_std: float = 0.3,
                 hidden: int = 128, emb_dim: int = 32):
        super().__init__()
        if not 0 < min_noise_std <= max_noise_std:
            raise ValueError(f"need 0 < min_noise_std <= max_noise_std, got {min_noise_std}, {max_noise_std}")
        self.t_emb = SinusoidalEmbedding(emb_dim, scale=100.0)
        self.body = mlp([emb_dim + obs_in, hidden, hidden, action_dim], act=nn.Mish)
        self.min_noise_std = min_noise_std
        self.register_buffer("max_noise_std", torch.tensor(float(max_noise_std)))

    def forward(self, t: torch.Tensor, obs_flat: torch.Tensor) -> torch.Tensor:  # [B], [B, To*O] -> [B, A]
        z = self.body(torch.cat([self.t_emb(t), obs_flat], -1))
        lo = self.min_noise_std
        hi = torch.clamp(self.max_noise_std, min=lo)
        return lo + (hi - lo) * torch.sigmoid(z)


class NoisyVelocityUNet1D(nn.Module):
    """The base velocity net plus the noise net: ``(x, t, d, obs) -> (velocity, noise, noise_std)``.

    ``velocity [B, H, A]``, ``noise_std [B, A]`` and ``noise = noise_std * eps [B, H, A]`` (the
    per-dimension std is shared across the chunk's ``H`` steps; ``eps`` from ``generator``).
    """

    def __init__(self, base: nn.Module, noise_net: ExploreNoiseNet, visual: bool = False):
        super().__init__()
        self.base, self.noise_net, self.visual = base, noise_net, visual

    def obs_input(self, obs: torch.Tensor) -> torch.Tensor:
        """What the noise and value nets read of a normalised window ``[B, To, O]``: the flat window, or for a visual
        policy the velocity net's ``obs_encoder`` embedding ``[B, obs_emb_dim]``, detached (pixels are too wide for an
        MLP head, and these heads do not train the encoder)."""
        if self.visual:
            return self.base.obs_encoder(obs.flatten(1)).detach()
        return obs.flatten(1)

    def forward(self, x, t, d, obs, generator: torch.Generator | None = None):
        velocity = self.base(x, t, d, obs)                                   # [B, H, A]
        noise_std = self.noise_net(t, self.obs_input(obs))                    # [B, A]
        eps = torch.randn(x.shape, generator=generator).to(x.device)
        return velocity, noise_std[:, None, :] * eps, noise_std
