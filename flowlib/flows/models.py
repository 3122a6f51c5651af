"""Flow-matching generative models: ReFlow, MeanFlow and ShortCut.

Time convention (the one convention of flowlib, documented here once)
---------------------------------------------------------------------
``t = 0`` is noise, ``t = 1`` is data.  With ``x_0 ~ N(0, I)`` and ``x_1 ~ p_data``::

    x_t = (1 - t) * x_0 + t * x_1                      # linear interpolation path
    v   = d x_t / dt = x_1 - x_0                        # conditional velocity

(rectified flow, Liu et al. 2022, Eq. 1).  Sampling integrates the ODE ``dx/dt = v(x, t)`` from
``t = 0`` to ``t = 1`` on the uniform grid ``time_grid(K)`` with step ``dt = 1 / K``.  ShortCut
(Frans et al. 2024) and ReinFlow (Zhang et al. 2025) use this convention as written.  MeanFlow
(Geng et al. 2025) and pi0 / piRL write ``t = 1`` for noise; their equations are restated here
with ``t -> 1 - t`` and each docstring says so.

One network interface for all three models
------------------------------------------
Every model wraps a velocity network ``net(x, t, d, obs) -> [B, ...]`` whose second time-like
input ``d >= 0`` is the length of the jump the caller is about to take:

* ReFlow always asks for ``d = 0``: the instantaneous velocity ``v(x, t)``.
* MeanFlow reads ``d = s - t``: the average velocity ``u(x, t, s)`` over ``[t, s]``.
* ShortCut reads ``d`` as its step size: the shortcut ``s(x, t, d)``.

So one sampler serves all three: ``x <- x + dt * net(x, t, d(dt))`` (``FlowModel.sample``).
Tensors: ``x`` is ``[B, ...]`` (``[B, 2]`` for 2D toys, ``[B, H, A]`` for action chunks);
``t`` and ``d`` are ``[B]``; ``obs`` is ``[B, ...]`` or ``None``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def time_grid(num_steps: int, device=None) -> torch.Tensor:
    """The one sampling grid ``[0, 1/K, ..., 1]`` (``K + 1`` points), shared by sampling and re-scoring.

    A public ReinFlow implementation samples on ``linspace(0, 1, K)`` but re-scores log-probs on
    ``linspace(0, 1 - dt, K)``; using this single function for both makes that impossible.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return torch.linspace(0.0, 1.0, num_steps + 1, device=device)


def interpolate(x0: torch.Tensor, x1: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) x_0 + t x_1`` (rectified flow, Liu et al. 2022, Eq. 1); ``t`` is ``[B]``."""
    t = _expand(t, x0)
    return (1.0 - t) * x0 + t * x1


def _expand(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, 1, ..., 1]`` so a per-sample scalar broadcasts over ``like``."""
    return s.reshape(-1, *([1] * (like.dim() - 1)))


def _per_sample_mean(sq: torch.Tensor) -> torch.Tensor:
    """``[B, ...] -> [B]``: mean over every non-batch dimension."""
    return sq.flatten(1).mean(1)


def _reduce(per_sample: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Mean of a per-sample loss, optionally weighted per sample (``weight`` is ``[B]``)."""
    if weight is None:
        return per_sample.mean()
    if weight.shape != per_sample.shape:
        raise ValueError(f"weight must have shape {tuple(per_sample.shape)} (one per sample), got {tuple(weight.shape)}")
    return (weight * per_sample).mean()


def _check_finite(name: str, x: torch.Tensor) -> None:
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf: check the data and its normalisation")


class FlowModel(nn.Module):
    """Base class: holds the velocity net, an optional EMA copy, and the shared sampler.

    Subclasses define ``jump(dt)`` (the ``d`` the net is asked for when stepping by ``dt``) and
    ``loss``.
    """

    def __init__(self, net: nn.Module, ema_decay: float | None = None):
        super().__init__()
        self.net = net
        self.ema_decay = ema_decay
        self.ema = None
        if ema_decay is not None:
            if not 0.0 < ema_decay < 1.0:
                raise ValueError(f"ema_decay must be in (0, 1), got {ema_decay}")
            self.ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(ema_decay), use_buffers=True)
            self.ema.requires_grad_(False)

    @torch.no_grad()
    def update_ema(self) -> None:
        """Polyak-average the EMA copy towards the live net; call after every optimiser step."""
        if self.ema is not None:
            self.ema.update_parameters(self.net)

    def sampling_net(self, use_ema: bool = True) -> nn.Module:
        return self.ema.module if (use_ema and self.ema is not None) else self.net

    @torch.no_grad()
    def adopt_ema(self) -> None:
        """Copy the EMA weights into the live net (no-op without an EMA): a fine-tune then starts from the policy that
        was scored (stage 1 evaluates and saves ``best_model.pt`` by its EMA), not from the raw net behind it."""
        if self.ema is not None:
            self.net.load_state_dict(self.ema.module.state_dict())

    def jump(self, dt: float) -> float:
        raise NotImplementedError

    def step_velocity(self, net: nn.Module, x, t, dt: float, obs=None) -> torch.Tensor:
        """Velocity used for one Euler step of size ``dt`` from time ``t`` (``[B]``)."""
        d = torch.full_like(t, self.jump(dt))
        return net(x, t, d, obs)

    @torch.no_grad()
    def sample(self, noise: torch.Tensor, num_steps: int, obs=None, use_ema: bool = True,
               return_trajectory: bool = False):
        """Integrate from ``x_0 = noise`` (t = 0) to t = 1 in ``num_steps`` equal steps.

        Returns ``x_1`` (``[B, ...]``), or ``(x_1, trajectory)`` with ``trajectory`` ``[K+1, B, ...]``.
        """
        return self.integrate(noise, num_steps, obs, use_ema, return_trajectory)

    def integrate(self, noise: torch.Tensor, num_steps: int, obs=None, use_ema: bool = True,
                  return_trajectory: bool = False):
        """``sample`` with autograd on: ``x_1`` is differentiable in ``noise`` (and in the net's weights unless
        the EMA copy, which is frozen, samples), e.g. to ask how far steering ``x_0`` can move the output."""
        net = self.sampling_net(use_ema)
        grid = time_grid(num_steps, noise.device)
        dt = 1.0 / num_steps
        x = noise
        trajectory = [x]
        for k in range(num_steps):
            t = grid[k].expand(x.shape[0])
            x = x + dt * self.step_velocity(net, x, t, dt, obs)
            if return_trajectory:
                trajectory.append(x)
        return (x, torch.stack(trajectory)) if return_trajectory else x


def sample_logit_normal(n: int, mu: float, sigma: float, device=None, generator=None) -> torch.Tensor:
    """``t = sigmoid(mu + sigma * eps)``, eps ~ N(0, 1) (Esser et al. 2024, Eq. 19)."""
    eps = torch.randn(n, device=device, generator=generator)
    return torch.sigmoid(mu + sigma * eps)


class ReFlow(FlowModel):
    """Rectified flow / conditional flow matching (Liu et al. 2022; Lipman et al. 2023).

    Loss (Liu et al. 2022, Eq. 1): ``E || v_theta(x_t, t) - (x_1 - x_0) ||^2`` with ``t ~ U[0, 1]``.
    The net is always asked for ``d = 0``: the instantaneous velocity.
    """

    def jump(self, dt: float) -> float:
        return 0.0

    def loss(self, x1: torch.Tensor, obs=None, weight=None):
        _check_finite("x1", x1)
        x0 = torch.randn_like(x1)
        t = torch.rand(x1.shape[0], device=x1.device)
        xt = interpolate(x0, x1, t)
        v = self.net(xt, t, torch.zeros_like(t), obs)
        per_sample = _per_sample_mean((v - (x1 - x0)) ** 2)
        loss = _reduce(per_sample, weight)
        return loss, {"loss": loss.item(), "mse": per_sample.mean().item()}


@dataclass
class MeanFlowTimes:
    """How MeanFlow draws its pairs of times ``t <= s`` (Geng et al. 2025, Sec. 4.3)."""

    mu: float = 0.4             # logit-normal location: the paper's best -0.4, time-flipped (t = 0 is noise)
    sigma: float = 1.0          # logit-normal scale
    share_distinct: float = 0.25  # share of pairs with s != t (paper: 25% works best)


class MeanFlow(FlowModel):
    """MeanFlow: learn the average velocity and sample in one step (Geng et al. 2025).

    In flowlib's convention (t = 0 noise) the average velocity over ``[t, s]``, ``s >= t``, is
    ``u(x_t, t, s) = 1/(s - t) * int_t^s v(x_tau, tau) dtau``, so ``x_s = x_t + (s - t) u``.
    Differentiating ``(s - t) u = int_t^s v`` in ``t`` gives the MeanFlow identity
    (paper Eq. 6, written there with t = 1 as noise, ``u = v - (t - r) du/dt``)::

        u_tgt = v + (s - t) * du/dt,     du/dt = v . d_x u + d_t u           (Eq. 6 and 8, time-flipped)

    ``du/dt`` is one ``torch.func.jvp`` of ``u`` along tangents ``(v, 1, 0)`` for ``(x, t, s)``
    (the paper's ``(v, 0, 1)`` for ``(z, r, t)``), with the conditional velocity ``v = x_1 - x_0``.
    The target is detached (stop-gradient, Eq. 9).  The squared error is weighted adaptively by
    ``w = 1 / (||err||^2 + eps)^p`` (detached; paper Sec. 4.3).  ``p = 1`` turns the loss into
    ``log ||err||^2``, whose minimiser is not the conditional mean of the noisy target; in 2D it
    ruins few- and many-step samples, so the default here is ``p = 0.5`` (the paper's other choice).
    The net sees ``d = s - t``; sampling with ``K`` steps asks for ``d = 1/K``.
    """

    def __init__(self, net: nn.Module, ema_decay: float | None = None, times: MeanFlowTimes | None = None,
                 adaptive_p: float = 0.5, adaptive_eps: float = 1e-3):
        super().__init__(net, ema_decay)
        self.times = times or MeanFlowTimes()
        self.adaptive_p = adaptive_p
        self.adaptive_eps = adaptive_eps

    def jump(self, dt: float) -> float:
        return dt

    def sample_times(self, n: int, device=None):
        """``(t, s)`` with ``t <= s``; a share ``share_distinct`` of pairs has ``s != t``."""
        a = sample_logit_normal(n, self.times.mu, self.times.sigma, device)
        b = sample_logit_normal(n, self.times.mu, self.times.sigma, device)
        t, s = torch.minimum(a, b), torch.maximum(a, b)
        same = torch.rand(n, device=device) >= self.times.share_distinct
        s = torch.where(same, t, s)
        return t, s

    def mean_velocity(self, x, t, s, obs=None) -> torch.Tensor:
        """``u(x, t, s)``: the net asked for a jump of ``d = s - t``."""
        return self.net(x, t, s - t, obs)

    def target(self, xt, t, s, v, obs=None):
        """``(u, u_tgt)``: prediction with gradient and the detached MeanFlow target (Eq. 6, 8).

        Pairs with ``s = t`` have ``u_tgt = v`` (plain flow matching), so the JVP runs only on the
        pairs with a real jump (25% by default): same result, about half the cost.
        """
        jump = s > t
        same_idx, jump_idx = (~jump).nonzero().squeeze(1), jump.nonzero().squeeze(1)
        sub = (lambda i: None) if obs is None else (lambda i: obs[i])
        u_parts, tgt_parts = [], []
        if same_idx.numel():
            u_parts.append(self.mean_velocity(xt[same_idx], t[same_idx], s[same_idx], sub(same_idx)))
            tgt_parts.append(v[same_idx])
        if jump_idx.numel():
            obs_j = sub(jump_idx)
            t_j, s_j, v_j = t[jump_idx], s[jump_idx], v[jump_idx]
            u_j, dudt = torch.func.jvp(
                lambda x_, t_, s_: self.mean_velocity(x_, t_, s_, obs_j),
                (xt[jump_idx], t_j, s_j),
                (v_j, torch.ones_like(t_j), torch.zeros_like(s_j)),
            )
            u_parts.append(u_j)
            tgt_parts.append(v_j + _expand(s_j - t_j, v_j) * dudt)
        inverse = torch.argsort(torch.cat([same_idx, jump_idx]))
        return torch.cat(u_parts)[inverse], torch.cat(tgt_parts)[inverse].detach()

    def loss(self, x1: torch.Tensor, obs=None, weight=None):
        _check_finite("x1", x1)
        x0 = torch.randn_like(x1)
        t, s = self.sample_times(x1.shape[0], x1.device)
        xt = interpolate(x0, x1, t)
        v = x1 - x0
        u, u_tgt = self.target(xt, t, s, v, obs)
        sq = (u - u_tgt).pow(2).flatten(1).sum(1)  # [B]
        w = (sq.detach() + self.adaptive_eps).pow(-self.adaptive_p)
        loss = _reduce(w * sq, weight)
        return loss, {"loss": loss.item(), "mse": (sq / u[0].numel()).mean().item()}


class ShortCut(FlowModel):
    """ShortCut model: a flow conditioned on the step size (Frans et al. 2024).

    ``s(x_t, t, d)`` is the velocity to use for a jump of size ``d``.  The batch is split:

    * a share ``1 - bootstrap_fraction`` gets the flow-matching target at the smallest step
      ``d_min = 1 / max_steps`` (paper Eq. 5, first term): ``s(x_t, t, d_min) ~ x_1 - x_0``;
    * a share ``bootstrap_fraction`` (public code: 1/4; 1/8 in the paper's text) gets the
      self-consistency target (paper Eq. 5, second term)::

          s(x_t, t, 2d) ~ [ s(x_t, t, d) + s(x'_{t+d}, t+d, d) ] / 2,   x'_{t+d} = x_t + d s(x_t, t, d)

      computed by the EMA teacher without gradient, with ``d in {d_min, 2 d_min, ..., 1/2}``
      drawn uniformly in log2 and ``t`` on the grid of multiples of ``2d``.

    Sampling with ``K`` steps asks for ``d = 1/K``; ``K`` must divide into powers of two up to
    ``max_steps``.
    """

    def __init__(self, net: nn.Module, ema_decay: float | None = 0.999, max_steps: int = 128,
                 bootstrap_fraction: float = 0.25):
        super().__init__(net, ema_decay)
        if max_steps < 2 or max_steps & (max_steps - 1):
            raise ValueError(f"max_steps must be a power of two >= 2, got {max_steps}")
        if not 0.0 <= bootstrap_fraction < 1.0:
            raise ValueError(f"bootstrap_fraction must be in [0, 1), got {bootstrap_fraction}")
        self.max_steps = max_steps
        self.bootstrap_fraction = bootstrap_fraction

    @property
    def d_min(self) -> float:
        return 1.0 / self.max_steps

    def jump(self, dt: float) -> float:
        if dt < self.d_min - 1e-12:
            raise ValueError(f"ShortCut was trained for at most max_steps={self.max_steps} steps; "
                             f"asked for a step of {dt:.3g}. Sample with fewer steps or retrain with a larger max_steps.")
        return dt

    def teacher(self) -> nn.Module:
        return self.ema.module if self.ema is not None else self.net

    @torch.no_grad()
    def consistency_target(self, xt, t, d, obs=None) -> torch.Tensor:
        """Two teacher steps of size ``d`` averaged: the target for one step of ``2d`` (Eq. 5)."""
        teacher = self.teacher()
        s1 = teacher(xt, t, d, obs)
        x_mid = xt + _expand(d, xt) * s1
        s2 = teacher(x_mid, t + d, d, obs)
        return 0.5 * (s1 + s2)

    def sample_bootstrap_times(self, n: int, device=None):
        """``(t, d)``: ``d = 2^-j`` with ``j`` uniform in ``1..log2(max_steps)``, ``t`` a multiple of ``2d``."""
        levels = int(math.log2(self.max_steps))
        j = torch.randint(1, levels + 1, (n,), device=device)
        d = torch.pow(2.0, -j.float())
        num_big = (0.5 / d).long()  # number of 2d-steps in [0, 1]
        i = (torch.rand(n, device=device) * num_big).floor()
        return i * 2 * d, d

    def loss(self, x1: torch.Tensor, obs=None, weight=None):
        """Per-sample weighted ShortCut loss; ``weight`` (``[B]``) scales both parts alike."""
        _check_finite("x1", x1)
        B = x1.shape[0]
        n_boot = int(round(B * self.bootstrap_fraction))
        x0 = torch.randn_like(x1)
        t = torch.rand(B, device=x1.device)
        d = torch.full((B,), self.d_min, device=x1.device)  # flow-matching part asks for d_min
        target = x1 - x0
        if n_boot > 0:
            t_b, d_b = self.sample_bootstrap_times(n_boot, x1.device)
            t = torch.cat([t_b, t[n_boot:]])
            d = torch.cat([d_b, d[n_boot:]])
        xt = interpolate(x0, x1, t)
        if n_boot > 0:
            obs_b = None if obs is None else obs[:n_boot]
            boot_target = self.consistency_target(xt[:n_boot], t[:n_boot], d[:n_boot], obs_b)
            target = torch.cat([boot_target, target[n_boot:]])
            d = torch.cat([2 * d[:n_boot], d[n_boot:]])  # the student jumps 2d in one step
        pred = self.net(xt, t, d, obs)
        per_sample = _per_sample_mean((pred - target) ** 2)
        loss = _reduce(per_sample, weight)
        info = {"loss": loss.item(), "flow_mse": per_sample[n_boot:].mean().item()}
        if n_boot > 0:
            info["consistency_mse"] = per_sample[:n_boot].mean().item()
        return loss, info


METHODS = {"reflow": ReFlow, "meanflow": MeanFlow, "shortcut": ShortCut}
