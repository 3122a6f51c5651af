"""``DDPM``: the diffusion baseline of stage 1, an epsilon-prediction denoising diffusion model (Ho et al. 2020) on the
same velocity nets as the flows, sampled by DDPM's ancestral chain or by DDIM (Song et al. 2021) through ``diffusers``'
schedulers (the ecosystem's standard; no hand-written scheduler).

Time convention, and how it meets flowlib's
-------------------------------------------
Diffusion papers write ``x_0`` for data and ``x_T`` for noise; flowlib writes ``x_1`` for data and ``x_0`` for noise
(``flowlib.flows.models``).  Here the diffusion convention is kept inside the equations and the flowlib names at the
interface: ``loss(x1, obs)`` takes data, ``integrate(noise, K, obs)`` starts from noise, as every flow does.  With the
integer timestep ``k in {0, ..., T-1}`` and ``alpha_bar_k`` the cumulative product of ``1 - beta``::

    x_k = sqrt(alpha_bar_k) * data + sqrt(1 - alpha_bar_k) * eps,   eps ~ N(0, I)      (Ho et al. 2020, Eq. 4)
    L   = E_{k, eps} || eps - eps_theta(x_k, k | o) ||^2                                 (Ho et al. 2020, Eq. 14)

The net is the flows' ``net(x, t, d, obs)`` asked with ``t = k / T`` and ``d = 0``: with its embedding scale of 100 and
``T = 100`` the sinusoidal embedding sees the integer ``k``, as Diffusion Policy's U-Net does (Chi et al. 2023).

Sampling with ``K`` steps visits the timesteps ``T-1, ..., `` spaced ``T / K`` apart and ending at noise level 0
("trailing" spacing, Lin et al. 2024, Sec. 3.3: with "leading" spacing a 1-step sampler would start at ``k = 0``, a
timestep that means "almost clean", from pure noise).  ``sampler``:

* ``"ddpm"``: the ancestral chain (Ho et al. 2020, Alg. 2; strided when ``K < T``), stochastic.  Its per-step noise is
  drawn, row by row, from a generator seeded by that row's ``x_0`` bytes: a chain is a function of its ``x_0``, so a
  seeded evaluation is reproducible and an episode does not depend on how episodes are batched.
* ``"ddim"``: the deterministic DDIM update (Song et al. 2021, Eq. 12 with ``eta = 0``).

``clip_range`` clamps each step's predicted data to ``[-clip_range, clip_range]`` (0: no clamp): 1 for min-max
normalised actions (Diffusion Policy's setting), the demos' largest standardised action for standardised ones.  It
matters: at the first step of a 100-step schedule ``alpha_bar ~ 2e-7``, so the predicted data
``(x - sqrt(1 - alpha_bar) eps_theta) / sqrt(alpha_bar)`` carries the noise prediction's error times ~2,000; unclamped,
DDIM (which adds no fresh noise to wash it out) scored about 0 on FastAvoid where 100 ancestral steps did not
(docs/fast_tasks.md, "The flow against its DDPM twin").
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from flowlib.flows.models import FlowModel, _check_finite, _per_sample_mean, _reduce

SAMPLERS = ("ddpm", "ddim")


def _scheduler_config(num_train_timesteps: int, clip_range: float) -> dict:
    """Diffusion Policy's DDPM: the squared-cosine schedule (Nichol & Dhariwal 2021, Eq. 17), epsilon prediction."""
    return {"num_train_timesteps": num_train_timesteps, "beta_schedule": "squaredcos_cap_v2",
            "clip_sample": clip_range > 0, "clip_sample_range": float(clip_range) or 1.0,
            "prediction_type": "epsilon", "timestep_spacing": "trailing"}


def row_generators(x0: torch.Tensor) -> list[torch.Generator]:
    """One generator per row of ``x0 [B, ...]``, seeded by the row's bytes: the DDPM chain's noise as a function of its
    start, so equal starts give equal chunks whatever the batch."""
    rows = x0.detach().cpu().contiguous().flatten(1).numpy()
    seeds = [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") >> 1 for row in rows]
    return [torch.Generator(device=x0.device).manual_seed(s) for s in seeds]


class DDPM(FlowModel):
    """Epsilon-prediction DDPM over ``[B, ...]`` with a flow net (``d = 0``); EMA as the flows' (``FlowModel``).

    ``num_train_timesteps`` is ``T``; ``clip_range`` bounds each step's predicted data (module docstring); ``sampler`` ("ddpm" or "ddim") is what ``integrate`` runs, settable between
    evaluations (``policy.flow.sampler = "ddim"``).  ``integrate(noise, K)`` takes ``1 <= K <= T`` steps.
    """

    def __init__(self, net: nn.Module, ema_decay: float | None = 0.995, num_train_timesteps: int = 100,
                 clip_range: float = 1.0, sampler: str = "ddpm"):
        super().__init__(net, ema_decay)
        from diffusers import DDIMScheduler, DDPMScheduler  # ~3 s to import: only where a diffusion model is built

        if num_train_timesteps < 2:
            raise ValueError(f"num_train_timesteps must be >= 2, got {num_train_timesteps}")
        if not clip_range >= 0:
            raise ValueError(f"clip_range must be >= 0 (0: no clamp), got {clip_range}")
        config = _scheduler_config(num_train_timesteps, clip_range)
        self.schedulers = {"ddpm": DDPMScheduler(**config), "ddim": DDIMScheduler(**config)}
        self.num_train_timesteps = num_train_timesteps
        self.sampler = sampler

    @property
    def sampler(self) -> str:
        return self._sampler

    @sampler.setter
    def sampler(self, name: str) -> None:
        if name not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {name!r}")
        self._sampler = name

    def timestep_input(self, k: torch.Tensor) -> torch.Tensor:
        """The net's ``t`` for integer timesteps ``k [B]``: ``k / T``."""
        return k.float() / self.num_train_timesteps

    def loss(self, x1: torch.Tensor, obs=None, weight=None, timesteps: torch.Tensor | None = None,
             noise: torch.Tensor | None = None):
        """Ho et al. 2020, Eq. 14 (``L_simple``) on data ``x1 [B, ...]``, per-sample ``weight [B]`` as the flows'.
        ``timesteps [B]`` (integers) and ``noise`` (like ``x1``) are drawn uniformly / from N(0, I) unless given."""
        _check_finite("x1", x1)
        B = x1.shape[0]
        k = torch.randint(0, self.num_train_timesteps, (B,), device=x1.device) if timesteps is None else timesteps
        eps = torch.randn_like(x1) if noise is None else noise
        xk = self.schedulers["ddpm"].add_noise(x1, eps, k)  # Eq. 4
        pred = self.net(xk, self.timestep_input(k), torch.zeros(B, device=x1.device), obs)
        per_sample = _per_sample_mean((pred - eps) ** 2)
        loss = _reduce(per_sample, weight)
        return loss, {"loss": loss.item(), "flow_mse": per_sample.mean().item()}  # flow_mse: stage 1's logged name

    def integrate(self, noise: torch.Tensor, num_steps: int, obs=None, use_ema: bool = True,
                  return_trajectory: bool = False):
        """Denoise ``noise [B, ...]`` (``x_T``) in ``num_steps`` steps of ``self.sampler``; returns the data sample
        ``[B, ...]`` (or with ``return_trajectory`` also ``[K+1, B, ...]``).  DDIM is differentiable in ``noise``."""
        if not 1 <= num_steps <= self.num_train_timesteps:
            raise ValueError(f"num_steps must be in [1, {self.num_train_timesteps}] (the DDPM's training timesteps), "
                             f"got {num_steps}")
        net = self.sampling_net(use_ema)
        scheduler = self.schedulers[self.sampler]
        scheduler.set_timesteps(num_steps, device=noise.device)
        step_kwargs = {"generator": row_generators(noise)} if self.sampler == "ddpm" else {"eta": 0.0}
        zero = torch.zeros(noise.shape[0], device=noise.device)
        x, trajectory = noise, [noise]
        for k in scheduler.timesteps:
            eps = net(x, self.timestep_input(k.expand(x.shape[0])), zero, obs)
            x = scheduler.step(eps, k, x, **step_kwargs).prev_sample
            if return_trajectory:
                trajectory.append(x)
        return (x, torch.stack(trajectory)) if return_trajectory else x
