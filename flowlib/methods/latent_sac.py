"""Off-policy actor-critic over the initial noise of a frozen flow policy: DSRL's learner (Wagenmaker et al. 2025).

``flowlib.methods.latent`` steers the flow through ``x_0 ~ pi_phi(. | o) = N(mu_phi(o), sigma^2 I)`` and learns
``pi_phi`` with PPO: each decision is used for a few epochs, then dropped.  DSRL learns the same policy
off-policy.  The latent ``w = x_0`` is the action of an MDP whose dynamics include the frozen flow (the
deterministic chain maps ``w`` to the chunk), so a Q function over ``(o, w)`` can be fitted from a replay of
every decision so far.  With chunks as a semi-MDP (``ChunkRunner``: ``R = sum_{k<tau} gamma^k r``, discount
``gamma^tau``, none after a termination) the Bellman target of the twin critics is (SAC, Haarnoja et al. 2018,
Eq. 3 and 5 without the entropy term; clipped double Q, Fujimoto et al. 2018)::

    y = R + gamma^tau (1 - terminal) min_j Q_bar_j(o', w'),      w' ~ pi(. | o')

with ``Q_bar`` the Polyak-averaged targets.  SAC's actor maximises ``Q`` plus the policy's entropy; here the
regulariser is the KL divergence to the stage-1 policy's own latent distribution ``N(0, I)``, the one the flow was
trained to map to actions (KL-regularised RL, e.g. Ziebart 2010; Todorov 2007), with reparameterised
``w = mu(o) + sigma eps``::

    J_pi = E_o [ alpha KL(pi(. | o) || N(0, I)) / D - E_eps min_j Q_j(o, w) ]

Why not the entropy: the twin Q is fitted on latents near ``N(0, I)``, and an actor free to go anywhere within the
bound ascends the Q nets' spurious slopes in all ``D`` dims at once (measured while building this, with the
entropy: in the toy of ``tests/test_latent_sac.py``, where one dim of ``x_0`` pays, every dim of ``mu`` ran to the
bound; in PickCube training success fell from 0.5 to 0 within 10k env steps of the first actor update).  The KL's ``mu^2 / 2`` keeps each dim at zero unless Q pays for moving it, and its optimum alone is
the stage-1 policy.  The temperature follows a KL budget per dim (the dual step of SAC v2, Eq. 18, with the KL
in place of the entropy)::

    J_alpha = E [ -alpha (KL / D - sac_target_kl) ]

The KL is divided by the latent's ``D = H x A`` dims so that the target reads per dim whatever the chunk size.
Evaluation starts the chain from ``mu(o)``, as the PPO variant's does.  The agent is a ``LatentSteeringAgent``
plus the Q nets and ``log_alpha``: stage 3's checkpoints, ``flowlib.tools.evaluate`` and notebook 03 serve it
unchanged (``learner: sac``); its ``last.pt`` also holds the replay buffer, so a run resumes with the data it had.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from flowlib.envs.smdp import ChunkRunner
from flowlib.flows.distributions import gaussian_entropy
from flowlib.flows.nets import TwinQ, frozen
from flowlib.infra.config import NonNegativeFloat, PositiveFloat
from flowlib.infra.guards import require_finite
from flowlib.methods.latent import LatentSteeringAgent
from flowlib.rl.buffers import ReplayBuffer
from flowlib.rl.learners import ReplayLearner, twin_q_step


@dataclass
class SACConfig:
    """DSRL's learner (``"sac"``): soft actor-critic over ``x_0`` with a KL to ``N(0, I)`` (``ReplayConfig`` too)."""

    sac_init_alpha: PositiveFloat = 1.0  # weight of KL(pi(x_0 | o) || N(0, I)) per dim in the actor's loss, at first
    sac_alpha_lr: NonNegativeFloat = 3.0e-3  # alpha's learning rate; 0: alpha stays at sac_init_alpha
    sac_target_kl: PositiveFloat = 0.1  # alpha moves so that the KL to N(0, I) is this, per dim


class LatentSACAgent(LatentSteeringAgent):
    """``LatentSteeringAgent``'s frozen flow and policy over ``x_0`` (its sampling and evaluation) with the twin
    ``Q(o, x_0)`` in place of PPO's ``V``, its Polyak target and the temperature ``alpha = exp(log_alpha)`` (module
    docstring)."""

    STATE_VALUE = False
    LEGACY_DROPPED = ("value_net.",)  # written when this agent carried PPO's V, untrained

    def __init__(self, policy, num_inference_steps: int = 8, min_noise_std: float = 0.05, max_noise_std: float = 1.0,
                 value_hidden_dims: tuple[int, ...] = (256, 256), latent_bound: float = 2.5,
                 latent_hidden: tuple[int, ...] = (256, 256), init_alpha: float = 0.01, **kwargs):
        super().__init__(policy, num_inference_steps, min_noise_std, max_noise_std, value_hidden_dims, latent_bound,
                         latent_hidden, **kwargs)
        if not init_alpha > 0:
            raise ValueError(f"init_alpha must be > 0, got {init_alpha}")
        self.latent_dim = self.pred_horizon * self.action_dim
        self.q = TwinQ(self.obs_horizon * self.obs_dim, self.latent_dim, tuple(value_hidden_dims))
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(math.log(init_alpha)))

    def value_parameters(self):
        return list(self.q.parameters())

    def rsample(self, o: torch.Tensor, eps: torch.Tensor):
        """Reparameterised ``w = mu(o) + sigma eps`` and the Gaussian's ``mu, sigma``: normalised ``o [B, To, O]``,
        ``eps [B, H, A]`` -> ``w [B, D]``, ``mu, sigma [B, H, A]``."""
        mu, sigma = self._latent(o)
        return (mu + sigma * eps).flatten(1), mu, sigma

    @torch.no_grad()
    def update_target(self, tau: float) -> None:
        """``Q_bar <- (1 - tau) Q_bar + tau Q``."""
        for p, p_bar in zip(self.q.parameters(), self.q_target.parameters()):
            p_bar.lerp_(p, tau)


def prior_kl(mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``KL(N(mu, sigma^2) || N(0, I)) / D`` per sample, ``[B, H, A]`` x2 -> ``[B]``: per dim,
    ``1/2 (sigma^2 + mu^2 - 1) - log sigma``."""
    return (0.5 * (sigma.pow(2) + mu.pow(2) - 1) - torch.log(sigma)).flatten(1).mean(1)


def sac_update(agent: LatentSACAgent, batch: dict[str, torch.Tensor], actor_opt, critic_opt, cfg,
               train_policy: bool = True) -> dict[str, float]:
    """One gradient step of the twin critics on the SMDP target, then (``train_policy``) of the actor and
    the temperature, then the Polyak step of the targets (module docstring).  ``actor_opt`` holds the policy's
    parameters and, when alpha learns, ``log_alpha`` in a group of its own."""
    device = agent.log_alpha.device
    b = {k: v.to(device) for k, v in batch.items()}
    o, o_next = agent.norm_obs(b["obs"]), agent.norm_obs(b["next_obs"])
    alpha = agent.log_alpha.exp().detach()
    with torch.no_grad():
        w_next, *_ = agent.rsample(o_next, torch.randn_like(b["latent"]))
        q_next = agent.q_target(o_next.flatten(1), w_next).min(0).values
        y = b["reward"] + b["bootstrap"] * q_next                                      # [B]
    q = agent.q(o.flatten(1), b["latent"].flatten(1))                                     # [2, B]
    stats = twin_q_step(q, y, critic_opt, agent.value_parameters(), cfg.max_grad_norm, "a SAC step")
    if train_policy:
        w, mu, sigma = agent.rsample(o, torch.randn_like(b["latent"]))                  # [B, D], [B, H, A] x2
        with frozen(agent.q):  # dQ/dw only: the critics' weight gradients would be dropped
            q_pi = agent.q(o.flatten(1), w).min(0).values
        kl = prior_kl(mu, sigma)                                                          # [B]
        actor_loss = (alpha * kl - q_pi).mean()
        alpha_loss = -(agent.log_alpha.exp() * (kl.detach() - cfg.sac_target_kl)).mean()
        actor_opt.zero_grad(set_to_none=True)
        (actor_loss + alpha_loss).backward()  # disjoint parameters: kl is detached in alpha_loss, alpha in actor_loss
        require_finite(nn.utils.clip_grad_norm_(agent.policy_parameters(), cfg.max_grad_norm),
                       "the latent policy's gradient norm", "a SAC step", "lower actor_lr")
        actor_opt.step()
        stats.update({"policy_loss": actor_loss.item(), "kl": kl.mean().item(),
                      "entropy": gaussian_entropy(sigma).mean().item(),
                      "mu_rms": mu.pow(2).mean().sqrt().item()})
    agent.update_target(cfg.target_tau)
    return stats


@torch.no_grad()
def collect(agent: LatentSACAgent, runner: ChunkRunner, buffer: ReplayBuffer, num_decisions: int,
            generator: torch.Generator | None = None) -> float:
    """``num_decisions`` decisions of every env with ``w ~ pi(. | o)``, each stored in ``buffer``; returns the
    policy's share of the wall time."""
    device = agent.log_alpha.device
    policy_time = 0.0
    for _ in range(num_decisions):
        tp = time.time()
        window = runner.window.clone()
        chain, _ = agent.sample(window.to(device), generator)
        actions = agent.actions(chain).cpu()
        policy_time += time.time() - tp
        out = runner.step_chunk(actions)
        buffer.add(obs=window, latent=chain[:, 0], reward=out["reward"],
                   bootstrap=out["discount"] * (~out["terminal"]).float(), next_obs=out["next_window"])
    return policy_time


def optimizers(agent: LatentSACAgent, cfg):
    """``(actor_opt, critic_opt)``: Adam over the policy (and ``log_alpha``, at ``sac_alpha_lr``, unless 0) and
    over the twin Q, with torch's fused kernel (``residual_step.optimizers``)."""
    groups = [{"params": agent.policy_parameters(), "lr": cfg.actor_lr}]
    if cfg.sac_alpha_lr > 0:
        groups.append({"params": [agent.log_alpha], "lr": cfg.sac_alpha_lr})
    else:
        agent.log_alpha.requires_grad_(False)
    return (torch.optim.Adam(groups, fused=True),
            torch.optim.Adam(agent.value_parameters(), lr=cfg.critic_lr, fused=True))


def latent_sac_agent(policy, cfg) -> LatentSACAgent:
    """The DSRL-SAC agent of ``cfg`` over a frozen stage-1/2 ``policy``."""
    return LatentSACAgent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                          tuple(cfg.value_hidden_dims), cfg.latent_bound, tuple(cfg.latent_hidden_dims),
                          init_alpha=cfg.sac_init_alpha, act_horizon=cfg.act_horizon, obs_clip=cfg.obs_clip)


def sac_learner(agent: LatentSACAgent, cfg) -> ReplayLearner:
    """DSRL-SAC: each iteration collects ``rollout_steps`` decisions per env into the replay, then takes
    ``replay_updates_per_decision`` gradient steps per new decision on batches of ``replay_batch_size``
    (``sac_update``; the critics only in the warm-up, none until the replay holds one batch)."""
    def make_collect(runner, generator):
        return lambda buffer: collect(agent, runner, buffer, cfg.rollout_steps, generator)

    def update_step(learner, batch, train_policy, i):
        return sac_update(agent, batch, learner.actor_opt, learner.critic_opt, cfg, train_policy)

    def after_update(learner):
        with torch.no_grad():  # sigma is one learned std per dim of x_0
            _, sigma = agent._latent(agent.norm_obs(learner.runner.window[:1].to(agent.log_alpha.device)))
        return {"alpha": agent.log_alpha.exp().item(), "noise_std": sigma.log().mean().exp().item()}

    buffer = ReplayBuffer(cfg.replay_size, (agent.obs_horizon, agent.obs_dim), (agent.pred_horizon, agent.action_dim))
    return ReplayLearner(agent, cfg, buffer, make_collect, update_step, optimizers,
                         lambda num_envs: cfg.rollout_steps * num_envs, "DSRL-SAC", after_update=after_update)
