"""PPO as every stage-3 method runs it: its config, the losses and the update.  The advantages it follows are
``flowlib.rl.advantages``' (GAE, Monte-Carlo, n-step, GRPO, branch), which ``flowlib.rl.buffers`` computes.

Losses: the clipped surrogate (Schulman et al. 2017, Eq. 7) with the dual clip of Ye et al. 2020 (Eq. 5:
for ``A < 0`` the loss is at most ``-c A``, ``c > 1``), a value loss that is squared or Huber and optionally
clipped around the rollout's values, and the entropy bonus.  ``ppo_update`` runs epochs of minibatches with
grad-norm clipping, ``target_kl`` early stop, and checks that the ratio is 1 on the first minibatch.

Two ratio formulations (piRL Sec. 4.2): ``joint`` (one-layer MDP: the chain is one action, one ratio from
the summed log-probs of its stochastic steps) and ``per_step`` (two-layer MDP: every stochastic denoising
step is a transition of the inner MDP with zero reward and no discount, so it gets the env decision's
advantage and its own clipped ratio; the loss averages over the stochastic steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from flowlib._moved import moved_names
from flowlib.infra.config import Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from flowlib.infra.guards import require_finite
from flowlib.rl.advantages import ESTIMATORS

ADV_NORMS = ("batch", "minibatch", "off")  # where the advantages are standardised (``standardise``)


@dataclass
class PPOConfig:
    """The settings of the advantage estimators and of ``ppo_update`` (learner ``"ppo"`` of stage 3).  Notebook 03
    reads them as flat parameters: ``stage3.Stage3Config`` composes this class with the other learners'.  An option
    marked ``[toolkit: <row>]`` is measured in that row of docs/results/toolkit.md."""

    update_epochs: PositiveInt = 2  # passes over the rollout per update
    policy_epochs: NonNegativeInt = 0   # epochs of each update that train the policy (0: all); the value fits all
    minibatch_size: PositiveInt = 16  # decisions per gradient step
    micro_batch_size: NonNegativeInt = 0  # rows per forward/backward pass in a minibatch (gradient accumulation); 0: all
    advantage: str = "gae"              # gae / mc / nstep / grpo / branch (ESTIMATORS) [toolkit: adv_*]
    gae_lambda: Fraction = 0.95  # GAE's lambda (advantage "gae")
    n_step: PositiveInt = 5             # decisions, for advantage "nstep" [toolkit: adv_nstep]
    group_size: PositiveInt = 2         # envs per GRPO group (same env seed); num_envs a multiple [toolkit: adv_grpo]
    branches: PositiveInt = 1           # chains tried per decision from one env state (advantage "branch"; physx_cpu)
    clip_coef: PositiveFloat = 0.2  # the ratio's clip, 1 +- clip_coef (Schulman et al. 2017, Eq. 7)
    dual_clip: NonNegativeFloat = 0.0   # c > 1 caps the loss of negative-advantage samples at -c A; 0: off
                                        # [toolkit: dual_clip_3]
    value_clip: NonNegativeFloat = 0.0  # > 0: V clipped to the rollout's values +- this (PPO2); 0: unclipped
                                        # [toolkit: value_clip_0.2, huber_value_clip]
    huber_delta: NonNegativeFloat = 0.0  # > 0: Huber value loss with this delta; 0: squared [toolkit: huber_value_clip]
    ent_coef: NonNegativeFloat = 0.01  # weight of the entropy bonus
    vf_coef: NonNegativeFloat = 0.5  # weight of the value loss
    actor_optimizer: str = "adam"       # "adam", or "sgd": steps along the (norm-clipped) gradient itself
    target_kl: NonNegativeFloat = 0.0   # approx KL past which an update stops early (0: never)
    kl_stop: str = "all"                # past target_kl: "all" ends the update, "policy" keeps fitting the value
    adv_norm: str = "batch"  # advantages standardised over the whole batch, per "minibatch", or "off"
                             # [toolkit: adv_norm_minibatch, adv_norm_off]
    flip_advantages: bool = False  # a control: PPO ascends -A, so a method that learns must get worse
    ratio_mode: str = "joint"           # "joint" (one-layer MDP) or "per_step" (two-layer: a ratio per step)
                                        # [toolkit: ratio_per_step]
    reward_scaling: bool = False        # rewards / running std of the discounted return (ReinFlow's, DPPO's)

    def ppo_checks(self) -> list[tuple[bool, str]]:
        """``(ok, message)`` per check across these fields (``config.require`` raises the first that fails)."""
        return [
            (self.policy_epochs <= self.update_epochs,
             f"policy_epochs must be in [0, update_epochs = {self.update_epochs}] (0: all), got {self.policy_epochs}"),
            (self.kl_stop in ("all", "policy"), f"kl_stop must be 'all' or 'policy', got {self.kl_stop!r}"),
            (self.actor_optimizer in ("adam", "sgd"),
             f"actor_optimizer must be 'adam' or 'sgd', got {self.actor_optimizer!r}"),
            (self.ratio_mode in ("joint", "per_step"), f"ratio_mode must be 'joint' or 'per_step', got {self.ratio_mode!r}"),
            (self.advantage in ESTIMATORS, f"advantage must be one of {ESTIMATORS}, got {self.advantage!r}"),
            (self.group_size >= 2, "group_size must be >= 2 (a group of one has no baseline)"),
            (self.dual_clip == 0 or self.dual_clip > 1, "dual_clip must be 0 (off) or > 1"),
            (self.adv_norm in ADV_NORMS, f"adv_norm must be one of {ADV_NORMS}, got {self.adv_norm!r}"),
        ]


def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    """``1 - Var[target - pred] / Var[target]`` (1 = perfect, 0 = no better than the mean)."""
    var = target.var()
    return float("nan") if var == 0 else float(1 - (target - pred).var() / var)


# --------------------------------------------------------------------------- losses


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip: float, dual_clip: float = 0.0) -> torch.Tensor:
    """Per-element PPO policy loss ``-min(rho A, clip(rho, 1 +- eps) A)`` (Schulman et al. 2017, Eq. 7).

    With ``dual_clip = c > 1`` (Ye et al. 2020, Eq. 5), for ``A < 0`` the loss is capped at ``-c A``: a huge
    ratio on a bad action can no longer dominate the batch.
    """
    loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    if dual_clip:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or 0 for off), got {dual_clip}")
        loss = torch.where(adv < 0, torch.min(loss, -dual_clip * adv), loss)
    return loss


def value_loss(value: torch.Tensor, old_value: torch.Tensor, returns: torch.Tensor, clip: float = 0.0,
               huber_delta: float = 0.0) -> torch.Tensor:
    """Per-element value loss: ``0.5 (V - G)^2`` or Huber(``delta``); with ``clip > 0`` the max of the loss of
    ``V`` and of ``V`` clipped to ``old_value +- clip`` (PPO2's value clipping)."""
    def f(pred):
        if huber_delta:
            return F.huber_loss(pred, returns, reduction="none", delta=huber_delta)
        return 0.5 * (pred - returns) ** 2
    loss = f(value)
    if clip > 0:
        loss = torch.max(loss, f(old_value + (value - old_value).clamp(-clip, clip)))
    return loss


def _masked_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum() / w.sum().clamp(min=1e-8)


def standardise(adv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(A - mean) / (std + 1e-8)`` over the rows of weight ``w > 0`` (weighted); as is when at most one weight is
    live (a mean of one row would zero it)."""
    if w.sum() <= 1:
        return adv
    mean = _masked_mean(adv, w)
    return (adv - mean) / (_masked_mean((adv - mean) ** 2, w).sqrt() + 1e-8)


# --------------------------------------------------------------------------- the update


def _row_weights(stochastic: torch.Tensor, w: torch.Tensor, ratio_mode: str) -> torch.Tensor:
    """The weight of each ratio in the policy loss: ``[b, 1]`` (joint: one per sample) or ``[b, K]`` (per_step:
    a sample's weight shared among its stochastic steps)."""
    if ratio_mode == "joint":
        return w[:, None]
    return w[:, None] * stochastic.float() / stochastic.float().sum(1, keepdim=True).clamp(min=1)


def _policy_sums(agent, batch: dict[str, torch.Tensor], idx: torch.Tensor, adv: torch.Tensor, w: torch.Tensor,
                 cfg) -> dict[str, torch.Tensor]:
    """The policy's terms on rows ``idx`` as weighted sums (the caller divides by the minibatch's totals, so a
    minibatch may be split into micro-batches): the clipped surrogate (``policy_loss``), the noise entropy, and
    over the live ratios Schulman's k3 estimate of the approx KL, the clipped count and the largest |ratio - 1|."""
    stoch = batch["stochastic"][idx]
    step_lp, entropy = agent.step_log_probs(batch["obs"][idx], batch["chains"][idx], stoch)
    if cfg.ratio_mode == "joint":
        new = agent.joint_log_prob(step_lp, stoch, batch["chains"][idx])
        log_ratio = (new - batch["log_probs"][idx])[:, None]                    # [b, 1]
        surrogate = clipped_surrogate(log_ratio.exp(), adv[:, None], cfg.clip_coef, cfg.dual_clip)
    else:  # per_step: one ratio per stochastic denoising step (two-layer MDP)
        log_ratio = torch.where(stoch, step_lp - batch["step_log_probs"][idx], 0.0)  # [b, K]
        surrogate = clipped_surrogate(log_ratio.exp(), adv[:, None].expand_as(log_ratio), cfg.clip_coef, cfg.dual_clip)
    row_w = _row_weights(stoch, w, cfg.ratio_mode)
    ratio, live = log_ratio.exp(), row_w > 0
    out = {"policy_loss": (surrogate * row_w).sum(), "entropy": (entropy * w).sum()}    # these two carry gradients
    with torch.no_grad():
        err = (ratio - 1)[live].abs()
        out |= {"approx_kl": ((ratio - 1) - log_ratio)[live].sum(), "clip_frac": (err > cfg.clip_coef).sum(),
                "live": live.sum(), "ratio_err": err.max() if len(err) else torch.zeros(())}
    return out


def ppo_update(agent, batch: dict[str, torch.Tensor], actor_opt, critic_opt, cfg, train_policy: bool = True,
               generator: torch.Generator | None = None, regularisers=()) -> dict[str, float]:
    """Epochs of PPO minibatches over a flat batch of chain decisions.

    ``batch``: ``obs``, ``chains [n, K+1, H, A]`` (or whatever decision the agent scores, ``flowlib.rl.buffers``),
    ``stochastic [n, K]``, ``log_probs [n]`` (joint) and
    ``step_log_probs [n, K]`` (at sampling), ``values``, ``advantages``, ``returns`` and optionally
    ``weights [n]`` (0 drops a row) and ``states [n, P]`` (what an asymmetric V reads: ``value(obs, states)``).
    ``agent`` provides ``value(obs)``, ``step_log_probs(obs, chains, stochastic) -> ([n, K], entropy [n])``,
    ``joint_log_prob(step_log_probs, stochastic, chains)``, ``policy_parameters()``, ``value_parameters()``.
    ``cfg`` provides the fields of ``PPOConfig`` and ``max_grad_norm``.

    ``L = policy_loss - c_H H[noise] + c_v value_loss (+ sum_j c_j R_j)`` over the optional ``regularisers``, each a
    penalty of the policy with its weight ``coeff`` and its log name ``name``: ``weights(batch, idx, w) -> [b]`` gives
    each minibatch row's weight in it, and ``regulariser(batch, rows, weights, generator)`` the weighted sum of its
    per-row penalty over ``rows``; ``R_j`` is that sum over the minibatch divided by the weights' total (ReinFlow's W2
    pull to the start policy, ``flowlib.methods.reinflow.W2Regulariser``, logged as ``bc_loss``; RFC beside PPO, the
    masked ShortCut loss on the rollout's chunks, ``flowlib.methods.rfc.RFCRegulariser``, as ``rfc_loss``).

    Before the first optimiser step the stored and re-scored log-probs are the same computation on the same grid, so
    every ratio must be 1: checked on the first minibatch, every update.  ``train_policy=False`` (critic warm-up)
    fits only the value.

    ``target_kl`` early stop: once a minibatch's approx KL exceeds it, ``cfg.kl_stop = "all"`` ends the
    update (CleanRL), ``"policy"`` freezes the policy and fits the value for the remaining epochs, so a
    critic still catching up is not starved by a policy that moves fast.  ``cfg.policy_epochs`` (``E_pi``;
    0 = every epoch) trains the policy in the first ``E_pi`` epochs only, so each sample moves it once while
    the value fits all ``update_epochs`` (``E_V``): the split of Phasic Policy Gradient (Cobbe et al. 2021).

    ``cfg.micro_batch_size`` (0: the whole minibatch) runs each minibatch through the nets in slices of that
    many rows and adds up their gradients before the one optimiser step (gradient accumulation): the same
    update, in the memory of a slice.  On CPU it is also faster for big minibatches (the U-Net's activations
    stay in cache: 2.0 ms per row at 512 rows, 4.2 at 4,096, 1 thread).
    """
    device = next(agent.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    n = len(batch["returns"])
    weights = batch.get("weights", torch.ones(n, device=device))
    adv_all = batch["advantages"]
    if cfg.adv_norm == "batch":  # "minibatch": each minibatch standardises its own rows, below
        adv_all = standardise(adv_all, weights)
    stats: dict[str, list[float]] = {k: [] for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac",
                                                     *(r.name for r in regularisers))}
    first, stopped_early, epoch, policy_steps = True, False, 0, 0
    policy_epochs = cfg.policy_epochs or cfg.update_epochs
    for epoch in range(cfg.update_epochs):
        train_policy_now = train_policy and epoch < policy_epochs
        perm = torch.randperm(n, generator=generator).to(device)
        for start in range(0, n, cfg.minibatch_size):
            idx = perm[start:start + cfg.minibatch_size]
            w = weights[idx]
            if w.sum() == 0:
                continue
            adv = adv_all[idx]                                           # [b], in the minibatch's order
            if cfg.adv_norm == "minibatch":  # the rows of this minibatch, standardised among themselves
                adv = standardise(adv, w)
            step_policy = train_policy_now and not stopped_early
            w_total = w.sum()
            row_w_total = _row_weights(batch["stochastic"][idx], w, cfg.ratio_mode).sum().clamp(min=1e-8)
            sums = dict.fromkeys(("value_loss", "policy_loss", "entropy", "approx_kl", "clip_frac", "live",
                                  *(r.name for r in regularisers)), 0.0)
            reg_w = [r.weights(batch, idx, w) for r in regularisers]        # each penalty's row weights [b]
            reg_total = [rw.sum().clamp(min=1e-8) for rw in reg_w]
            actor_opt.zero_grad(set_to_none=True)
            critic_opt.zero_grad(set_to_none=True)
            size = cfg.micro_batch_size or len(idx)
            for i, micro in enumerate(idx.split(size)):                      # gradient accumulation
                part = slice(i * size, (i + 1) * size)                      # micro's rows within the minibatch
                wm = weights[micro]
                value = (agent.value(batch["obs"][micro], batch["states"][micro]) if "states" in batch
                         else agent.value(batch["obs"][micro]))  # an asymmetric V reads the simulator's state
                v_sum = (value_loss(value, batch["values"][micro], batch["returns"][micro], cfg.value_clip,
                                    cfg.huber_delta) * wm).sum()
                loss = cfg.vf_coef * v_sum / w_total
                sums["value_loss"] = sums["value_loss"] + v_sum.detach()   # tensors: no sync per slice
                if step_policy:
                    p = _policy_sums(agent, batch, micro, adv[part], wm, cfg)
                    if first and p["ratio_err"] > 1e-3:
                        raise RuntimeError(f"PPO ratio is {1 + p['ratio_err'].item():.4g}, not 1, before any "
                                           "update: sampling and re-scoring disagree (time grid, noise or "
                                           "normalisation differ)")
                    loss = loss + p["policy_loss"] / row_w_total - cfg.ent_coef * p["entropy"] / w_total
                    for reg, rw, total in zip(regularisers, reg_w, reg_total):
                        r_sum = reg(batch, micro, rw[part], generator)
                        loss = loss + reg.coeff * r_sum / total
                        sums[reg.name] = sums[reg.name] + r_sum.detach()
                    for key in ("policy_loss", "entropy", "approx_kl", "clip_frac", "live"):
                        sums[key] = sums[key] + p[key].detach()
                loss.backward()
            sums = {k: float(v) for k, v in sums.items()}                    # one sync per minibatch
            stats["value_loss"].append(sums["value_loss"] / w_total.item())
            at = f"epoch {epoch}, minibatch {start // cfg.minibatch_size}"  # both norms checked before either step
            require_finite(nn.utils.clip_grad_norm_(agent.value_parameters(), cfg.max_grad_norm),
                           "the value net's gradient norm", at, "lower critic_lr, or check the rewards for NaN")
            if step_policy:
                require_finite(nn.utils.clip_grad_norm_(agent.policy_parameters(), cfg.max_grad_norm),
                               "the policy's gradient norm", at, "lower actor_lr or clip_coef")
            critic_opt.step()
            if step_policy:
                first = False
                live = max(sums["live"], 1)
                stats["policy_loss"].append(sums["policy_loss"] / row_w_total.item())
                stats["entropy"].append(sums["entropy"] / w_total.item())
                stats["approx_kl"].append(sums["approx_kl"] / live)                # Schulman's k3
                stats["clip_frac"].append(sums["clip_frac"] / live)
                for reg, rw, total in zip(regularisers, reg_w, reg_total):
                    if rw.sum() > 0:  # a minibatch without a row the penalty weighs adds nothing to its mean
                        stats[reg.name].append(sums[reg.name] / total.item())
                actor_opt.step()
                policy_steps += 1
                if cfg.target_kl and stats["approx_kl"][-1] > cfg.target_kl:
                    stopped_early = True
                    if cfg.kl_stop == "all":
                        break
        if stopped_early and cfg.kl_stop == "all":
            break
    out = {k: float(sum(v) / len(v)) for k, v in stats.items() if v}
    out["epochs"] = epoch + 1
    out["policy_steps"] = policy_steps  # optimiser steps of the policy (target_kl and policy_epochs cut them)
    out["kl_early_stop"] = float(stopped_early)
    return out


# what moved to flowlib.rl.advantages (2026-12-07): old imports still work, with a warning
__getattr__ = moved_names(__name__, {name: "flowlib.rl.advantages" for name in (
    "gae", "mc_returns", "nstep_returns", "branch_advantages", "grpo_advantages", "RunningRewardScaler")})
