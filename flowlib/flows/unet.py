"""``ShortCutVelocityUNet1D``: a conditional 1D temporal U-Net over action chunks.

The architecture is Diffusion Policy's ``ConditionalUnet1D`` (Chi et al. 2023, Sec. 3.2 and
Fig. 2): residual Conv1d blocks over the time axis of the chunk, FiLM-conditioned (per-channel
scale and bias, Perez et al. 2018) on a global condition, here the embeddings of the flow time
``t``, the step size ``d`` and the observation window: flattened as it is, or through an ``obs_encoder``
(an MLP, or for pixels and points a ``flowlib.policies.encoders`` one), which stage 3 can keep frozen (``freeze_obs_encoder``).
Interface as every flowlib net: ``net(x [B, H, A], t [B], d [B], obs [B, To, O]) -> velocity [B, H, A]``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from flowlib.flows.nets import SinusoidalEmbedding, mlp


class Conv1dBlock(nn.Sequential):
    """Conv1d -> GroupNorm -> Mish."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, n_groups: int = 8):
        super().__init__(nn.Conv1d(c_in, c_out, kernel_size, padding=kernel_size // 2),
                         nn.GroupNorm(n_groups, c_out), nn.Mish())


class FiLMResBlock1D(nn.Module):
    """Two conv blocks; the condition sets a per-channel scale and bias after the first (FiLM)."""

    def __init__(self, c_in: int, c_out: int, cond_dim: int, kernel_size: int = 5, n_groups: int = 8):
        super().__init__()
        self.block1 = Conv1dBlock(c_in, c_out, kernel_size, n_groups)
        self.block2 = Conv1dBlock(c_out, c_out, kernel_size, n_groups)
        self.film = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, 2 * c_out))
        self.residual = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x, cond):  # x [B, C, H], cond [B, cond_dim]
        scale, bias = self.film(cond).unsqueeze(-1).chunk(2, dim=1)
        h = self.block1(x) * (1 + scale) + bias
        return self.block2(h) + self.residual(x)


def _check_inputs(net, x: torch.Tensor, obs: torch.Tensor | None) -> int:
    """The batch size of a chunk velocity net's ``x [B, H, A]`` and ``obs [B, To, O]``, or a clear error."""
    if x.shape[1:] != (net.pred_horizon, net.action_dim):
        raise ValueError(f"x must be [B, {net.pred_horizon}, {net.action_dim}], got {tuple(x.shape)}")
    if obs is None or obs.shape[1:] != (net.obs_horizon, net.obs_dim):
        got = None if obs is None else tuple(obs.shape)
        raise ValueError(f"obs must be [B, {net.obs_horizon}, {net.obs_dim}], got {got}")
    return x.shape[0]


def _obs_encoder(obs_in: int, obs_emb_dim: int, encoder: nn.Module | None) -> nn.Module | None:
    """A given encoder (``[B, obs_in] -> [B, obs_emb_dim]``, e.g. ``flowlib.policies.encoders.VisualObsEncoder``), else the
    two-layer MLP when ``obs_emb_dim > 0``, else none (the flat window conditions the net)."""
    if encoder is not None:
        if obs_emb_dim <= 0:
            raise ValueError("an obs_encoder needs obs_emb_dim > 0, the width of what it returns")
        return encoder
    return mlp([obs_in, obs_emb_dim, obs_emb_dim], act=nn.Mish) if obs_emb_dim > 0 else None


class ShortCutVelocityUNet1D(nn.Module):
    """Velocity net over action chunks ``[B, H, A]``, conditioned on ``t``, ``d`` and ``obs [B, To, O]``.

    ``down_dims`` sets the channel widths of the levels (each but the last halves ``H``, so ``H``
    must be divisible by ``2 ** (len(down_dims) - 1)``).  ``emb_dim`` is the width of the ``t`` / ``d``
    embedding; ``emb_scale`` the time-embedding scale (see ``flowlib.flows.nets.SinusoidalEmbedding``).
    ``obs_emb_dim``: 0 (the default, and every checkpoint before it) feeds the flattened window ``[B, To * O]``
    to FiLM as it is, with no ``obs_encoder``; ``> 0`` first maps it through ``obs_encoder``, a two-layer MLP
    ``[B, To * O] -> [B, obs_emb_dim]``: the one module that reads the observation, so it can be frozen alone.
    ``obs_encoder``: another such module in the MLP's place (a visual policy's, ``flowlib.policies.encoders``).
    """

    def __init__(self, action_dim: int, obs_dim: int, obs_horizon: int = 2, pred_horizon: int = 16,
                 down_dims: tuple[int, ...] = (64, 128, 256), emb_dim: int = 64, kernel_size: int = 5,
                 n_groups: int = 8, emb_scale: float = 100.0, obs_emb_dim: int = 0,
                 obs_encoder: nn.Module | None = None):
        super().__init__()
        levels = len(down_dims)
        if pred_horizon % (2 ** (levels - 1)):
            raise ValueError(f"pred_horizon={pred_horizon} must be divisible by 2^{levels - 1} for {levels} U-Net levels")
        self.action_dim, self.obs_dim, self.obs_horizon, self.pred_horizon = action_dim, obs_dim, obs_horizon, pred_horizon
        self.t_emb = SinusoidalEmbedding(emb_dim, scale=emb_scale)
        self.d_emb = SinusoidalEmbedding(emb_dim, scale=emb_scale)
        self.time_mlp = nn.Sequential(nn.Linear(2 * emb_dim, 4 * emb_dim), nn.Mish(), nn.Linear(4 * emb_dim, emb_dim))
        obs_in = obs_horizon * obs_dim
        self.obs_encoder = _obs_encoder(obs_in, obs_emb_dim, obs_encoder)
        cond_dim = emb_dim + (obs_emb_dim if obs_emb_dim > 0 else obs_in)
        dims = [action_dim, *down_dims]
        self.down = nn.ModuleList()
        for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:])):
            last = i == levels - 1
            self.down.append(nn.ModuleList([
                FiLMResBlock1D(c_in, c_out, cond_dim, kernel_size, n_groups),
                FiLMResBlock1D(c_out, c_out, cond_dim, kernel_size, n_groups),
                nn.Conv1d(c_out, c_out, 3, stride=2, padding=1) if not last else nn.Identity()]))
        self.mid = nn.ModuleList([FiLMResBlock1D(down_dims[-1], down_dims[-1], cond_dim, kernel_size, n_groups)
                                  for _ in range(2)])
        self.up = nn.ModuleList()
        for c_out, c_in in reversed(list(zip(dims[1:-1], dims[2:]))):  # the finest skip is not used, as in DP
            self.up.append(nn.ModuleList([
                FiLMResBlock1D(2 * c_in, c_out, cond_dim, kernel_size, n_groups),
                FiLMResBlock1D(c_out, c_out, cond_dim, kernel_size, n_groups),
                nn.ConvTranspose1d(c_out, c_out, 4, stride=2, padding=1)]))
        self.final = nn.Sequential(Conv1dBlock(down_dims[0], down_dims[0], kernel_size, n_groups),
                                   nn.Conv1d(down_dims[0], action_dim, 1))

    def forward(self, x, t, d, obs, return_features: bool = False):
        """``velocity [B, H, A]``; with ``return_features`` also the bottleneck features averaged over
        the horizon, ``[B, down_dims[-1]]`` (what a critic on the velocity net reads)."""
        B = _check_inputs(self, x, obs)
        obs_emb = obs.reshape(B, -1)  # [B, To * O]
        if self.obs_encoder is not None:
            obs_emb = self.obs_encoder(obs_emb)  # [B, obs_emb_dim]
        cond = torch.cat([self.time_mlp(torch.cat([self.t_emb(t), self.d_emb(d)], -1)), obs_emb], -1)
        h = x.transpose(1, 2)  # [B, A, H]
        skips = []
        for res1, res2, down in self.down:
            h = res2(res1(h, cond), cond)
            skips.append(h)
            h = down(h)
        for res in self.mid:
            h = res(h, cond)
        features = h.mean(-1)  # [B, C]
        for res1, res2, up in self.up:
            h = torch.cat([h, skips.pop()], dim=1)  # the skip of the same resolution
            h = up(res2(res1(h, cond), cond))
        velocity = self.final(h).transpose(1, 2)  # [B, H, A]
        return (velocity, features) if return_features else velocity


class ChunkVelocityMLP(nn.Module):
    """Velocity net over action chunks ``[B, H, A]`` as one flat MLP: ``[x (H*A), emb(t), emb(d), obs (To*O)] ->
    velocity (H*A)``, the interface of ``ShortCutVelocityUNet1D``.  ReinFlow's state-task configs use such an MLP; on a
    CPU it costs a fraction of the U-Net's time, which is what the policy's share of a fast task's env step is.
    ``hidden`` are the layer widths; the last is the features a critic on the velocity net reads."""

    def __init__(self, action_dim: int, obs_dim: int, obs_horizon: int = 2, pred_horizon: int = 16,
                 hidden: tuple[int, ...] = (256, 256, 256), emb_dim: int = 32, emb_scale: float = 100.0,
                 obs_emb_dim: int = 0, obs_encoder: nn.Module | None = None):
        super().__init__()
        self.action_dim, self.obs_dim, self.obs_horizon, self.pred_horizon = action_dim, obs_dim, obs_horizon, pred_horizon
        self.t_emb = SinusoidalEmbedding(emb_dim, scale=emb_scale)
        self.d_emb = SinusoidalEmbedding(emb_dim, scale=emb_scale)
        obs_in = obs_horizon * obs_dim
        self.obs_encoder = _obs_encoder(obs_in, obs_emb_dim, obs_encoder)
        width = pred_horizon * action_dim + 2 * emb_dim + (obs_emb_dim if obs_emb_dim > 0 else obs_in)
        self.body = nn.Sequential(mlp([width, *hidden], act=nn.Mish), nn.Mish())
        self.head = nn.Linear(hidden[-1], pred_horizon * action_dim)

    def forward(self, x, t, d, obs, return_features: bool = False):
        B = _check_inputs(self, x, obs)
        obs_emb = obs.reshape(B, -1)
        if self.obs_encoder is not None:
            obs_emb = self.obs_encoder(obs_emb)
        features = self.body(torch.cat([x.reshape(B, -1), self.t_emb(t), self.d_emb(d), obs_emb], -1))
        velocity = self.head(features).reshape(x.shape)
        return (velocity, features) if return_features else velocity
