"""What the chain's log-prob scores: which dims of each transition (``LOG_PROB_OVER``) and how the steps' terms become
the one log-prob of PPO's ratio (``LOG_PROB_REDUCE``), for ``flowlib.methods.reinflow_agent.ReinFlowAgent``.

The chain's log-likelihood is the sum of its transition log-densities (ReinFlow, Zhang et al. 2025, Eq. 5)::

    log pi(x_{0:K} | o) = log N(x_0; 0, I) [optional]  +  sum_k log N(x_{k+1}; mean_k, sigma_k^2 I)

``ChainScore`` holds the choices and the chunk's shape; the agent computes ``mean_k`` and ``sigma_k``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flowlib.flows.distributions import gaussian_log_prob

# Which dims of each transition enter the chain's log-prob (the ratio of PPO):
#   "chunk":         all H x A dims at every step: the exact likelihood of the chain (ReinFlow Eq. 5).
#   "executed_last": all dims at steps k < K-1, only the Ta executed actions at the last step.  Also exact for
#                    the policy gradient: the non-executed dims of x_K reach nothing, so their score has zero
#                    mean given the rest, and dropping it only removes variance.
#   "executed":      the executed actions at every step.  Biased: at an intermediate step the U-Net feeds the
#                    non-executed dims of x_k into the next step's executed dims, so how theta moves them is
#                    part of the gradient, and this drops it.  Kept because the early stage-3 runs of docs/stage3.md
#                    (params/03_reinflow/cpu*.yaml) used it.
LOG_PROB_OVER = ("chunk", "executed_last", "executed")

# How the scored step log-probs become the one log-prob of PPO's ratio:
#   "sum":      the joint log-likelihood of the chain (ReinFlow Eq. 5): the exact importance ratio.
#   "mean":     divided by the number of stochastic steps.
#   "mean_dim": divided by the number of scored Gaussian dims (steps x dims, and x_0 when included), as
#               ReinFlow's public code does (normalize_denoising_horizon and normalize_act_space_dimension).
#               The ratio is then the geometric mean of the per-dim ratios; its clip (0.01 there, after DPPO)
#               bounds the average per-dim move, while with "sum" a clip of 0.2 on a 100+-dim ratio allows
#               ~0.002 per dim.  Under Adam the gradient's scale does not matter, only this trust region.
LOG_PROB_REDUCE = ("sum", "mean", "mean_dim")


@dataclass
class ChainScore:
    """The scoring rules of a ``K``-step chain over chunks ``[H, A]`` whose ``Ta`` executed actions start at
    ``To - 1``; ``noise_corr`` (``rho``) correlates each step's noise along the chunk (``gaussian_log_prob``)."""

    K: int
    obs_horizon: int
    act_horizon: int
    pred_horizon: int
    action_dim: int
    over: str = "chunk"                 # LOG_PROB_OVER
    reduce: str = "sum"                 # LOG_PROB_REDUCE
    initial_noise: bool = False         # log N(x_0; 0, I) in the joint log-prob
    noise_corr: float = 0.0

    def __post_init__(self):
        for name, value, allowed in (("log_prob_over", self.over, LOG_PROB_OVER),
                                     ("log_prob_reduce", self.reduce, LOG_PROB_REDUCE)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

    def executed(self, x: torch.Tensor) -> torch.Tensor:  # [P, H, A] -> [P, Ta, A]
        start = self.obs_horizon - 1
        return x[:, start:start + self.act_horizon]

    def step(self, x_next, mean, std, k) -> torch.Tensor:  # [P, H, A] x3, step k (int or [P]) -> [P]
        """``log N(x_{k+1}; mean, std^2)`` over the dims ``over`` picks, with the noise correlated along the chunk by
        ``noise_corr`` (a subset of an equicorrelated chunk keeps its ``rho``)."""
        rho = self.noise_corr

        def executed(rows=slice(None)):
            return gaussian_log_prob(self.executed(x_next[rows]), self.executed(mean[rows]), self.executed(std[rows]), rho)

        if self.over == "executed":
            return executed()
        if self.over == "executed_last" and isinstance(k, int):  # sampling: one step for the whole batch
            return executed() if k == self.K - 1 else gaussian_log_prob(x_next, mean, std, rho)
        lp = gaussian_log_prob(x_next, mean, std, rho)
        if self.over == "executed_last":  # re-scoring: (sample, step) pairs, some at the last step
            last = k == self.K - 1
            lp[last] = executed(last)
        return lp

    def step_dims(self, device=None) -> torch.Tensor:  # [K]: Gaussian dims that step k scores
        every, executed = self.pred_horizon * self.action_dim, self.act_horizon * self.action_dim
        dims = torch.full((self.K,), executed if self.over == "executed" else every, device=device)
        if self.over == "executed_last":
            dims[-1] = executed
        return dims

    def scored_x0(self, x0: torch.Tensor) -> torch.Tensor:  # the dims of x_0 in the log-prob
        return self.executed(x0) if self.over == "executed" else x0

    def joint(self, step_log_probs: torch.Tensor, stochastic: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
        """``[B, K]`` step log-probs -> ``[B]``: the sum over the stochastic steps, plus ``log N(x_0; 0, I)``
        when the initial noise is included (it does not depend on the weights, so it cancels in the ratio
        unless the terms are averaged); ``reduce`` may divide it by the steps or the scored dims."""
        stochastic = stochastic.to(step_log_probs.dtype)
        terms = (step_log_probs * stochastic).sum(1)
        if self.initial_noise:
            x0 = self.scored_x0(chain[:, 0])
            terms = terms + gaussian_log_prob(x0, torch.zeros_like(x0), torch.ones_like(x0))
        if self.reduce == "sum":
            return terms
        if self.reduce == "mean":
            count = stochastic.sum(1) + int(self.initial_noise)
        else:  # mean_dim
            count = (stochastic * self.step_dims(stochastic.device)).sum(1)
            if self.initial_noise:
                count = count + self.scored_x0(chain[:1, 0]).numel()
        return terms / count.clamp(min=1)
