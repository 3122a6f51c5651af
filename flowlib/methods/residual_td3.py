"""TD3 on the per-step residual (``flowlib.methods.residual_step``): the learner of the target run, ``params/06_steering/cpu.yaml``.

Twin critics ``Q_1, Q_2 (s, r)`` of the state ``s = (o_t, a_b)`` and the residual ``r``, fitted on the clipped
double-Q target with target-policy smoothing (Fujimoto et al. 2018, Eq. 15)::

    y = reward + gamma (1 - terminal) min_j Q_bar_j(s', clip(mu_bar(s') + clip(eps, -c, c), -b, b)),
    eps ~ N(0, td3_target_noise^2)

(with ``td3_n_step`` = n > 1, the n-step return of ``flowlib.rl.buffers.NStepReturns``), and every ``td3_policy_delay``
critic steps the deterministic policy gradient ``max_phi Q_1(s, mu_phi(s))`` (their Alg. 1) and the Polyak step of
``mu_bar``; ``Q_bar`` follows ``Q`` after every critic step, the warm-up's included.

``asymmetric_critic`` (a visual policy): the critics read the simulator's state instead of the camera's embedding,
``Q(c, r)`` with ``c = (state_t, a_b)`` in every ``Q`` above, the actor still ``mu_phi(s)``
(``StepResidualAgent.critic_state``; ``flowlib.rl.asymmetric``).  The replay then keeps each transition's states too.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from flowlib.flows.nets import TwinQ, frozen
from flowlib.infra.config import NonNegativeFloat, NonNegativeInt, PositiveInt
from flowlib.infra.guards import require_finite
from flowlib.methods.residual_step import StepCollector, StepResidualAgent
from flowlib.rl.asymmetric import privileged_width
from flowlib.rl.buffers import ReplayBuffer
from flowlib.rl.learners import ReplayLearner, twin_q_step


class StepResidualTD3Agent(StepResidualAgent):
    """The per-step residual with TD3's twin critics ``Q(s, r)`` and the Polyak targets of the critics and the actor
    (module docstring; ``StepResidualAgent`` for the rest)."""

    CLIP_EXPLORATION = True  # the replay stores the draw clipped to +-b, as it ran

    def _build_critics(self, hidden: tuple[int, ...]) -> None:
        """Twin critics ``Q(s, r)`` and the Polyak targets of the critics and the actor."""
        self.residual_target = copy.deepcopy(self.residual_net).requires_grad_(False)
        self.q = TwinQ(self.critic_dim, self.action_dim, hidden)
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)

    def value_parameters(self):
        return list(self.q.parameters())

    def critic(self, s: torch.Tensor, r: torch.Tensor, target: bool = False) -> torch.Tensor:
        """``Q_1, Q_2 (s, r)`` ``[2, B]`` (``target``: the Polyak-averaged pair), with ``r / b`` as input, so that the
        correction enters the critics at the scale of the normalised observations."""
        return (self.q_target if target else self.q)(s, r / self.residual_bound)

    def critic_1(self, s: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``Q_1 (s, r)`` ``[B]`` alone, the critic the actor's deterministic policy gradient follows."""
        return self.q.q1(s, r / self.residual_bound)

    @torch.no_grad()
    def update_targets(self, tau: float, actor: bool = True) -> None:
        """``Q_bar <- (1 - tau) Q_bar + tau Q``, and with ``actor`` the same for ``mu_bar``."""
        pairs = [(self.q, self.q_target)] + ([(self.residual_net, self.residual_target)] if actor else [])
        for net, target in pairs:  # one fused op per net, not one per tensor (a TD3 step is overhead-bound on CPU)
            torch._foreach_lerp_(list(target.parameters()), list(net.parameters()), tau)


@dataclass
class TD3Config:
    """TD3 on the per-step residual (``"td3"``; ``ReplayConfig`` applies too)."""

    td3_target_noise: NonNegativeFloat = 0.05  # std of the target policy's smoothing noise (normalised action units)
    td3_noise_clip: NonNegativeFloat = 0.1  # ... clipped to +-td3_noise_clip
    td3_policy_delay: PositiveInt = 2  # critic steps per actor (and target) step
    td3_n_step: PositiveInt = 1  # the critics' target sums n rewards before it bootstraps
    residual_l2: NonNegativeFloat = 0.0  # the actor's loss adds residual_l2 * mean (r / b)^2: r stays 0 unless Q pays
    actor_lr_warmup_steps: NonNegativeInt = 0  # env steps past critic_warmup_steps over which the actor's lr ramps
                                               # from 0 to actor_lr (0: full at once)
    residual_bound_warmup_steps: NonNegativeInt = 0  # env steps past critic_warmup_steps over which the actor's bound
                                                     # grows from 0 to residual_bound (0: full at once)


def replay_buffer(agent: StepResidualAgent, capacity: int) -> ReplayBuffer:
    """Transitions ``obs [To, O]`` (a visual policy's: its embedding, ``StepResidualAgent.observe``), ``latent`` = the residual ``r [A]``, ``reward``, ``bootstrap`` =
    ``gamma (1 - terminal)``, ``next_obs``, and the base actions ``base``, ``next_base`` ``[A]`` (normalised)."""
    A, P = agent.action_dim, agent.privileged_dim
    obs = (agent.flow.obs_features_dim,) if agent.flow.visual else (agent.obs_horizon, agent.obs_dim)  # observe()'s
    priv = {"priv": (P,), "next_priv": (P,)} if P else {}  # an asymmetric critic's simulator states
    return ReplayBuffer(capacity, obs, (A,), base=(A,), next_base=(A,), **priv)


def actor_loss(agent: StepResidualTD3Agent, s: torch.Tensor, residual_l2: float = 0.0,
               c: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TD3's actor loss on the states ``s [B, S]``, ``-mean Q_1(c, mu_phi(s)) + residual_l2 mean (mu / b)^2``, and
    ``mu [B, A]`` (``c``: what the critics read, ``s`` unless they are asymmetric).  Its gradient in ``phi`` is the
    deterministic policy gradient (Silver et al. 2014, Theorem 1) through the critic (Fujimoto et al. 2018, Alg. 1);
    the critics get none (``frozen``)."""
    mu = agent.residual(s)                                                                    # [B, A]
    with frozen(agent.q):  # dQ_1/dr only: no weight gradients for the critics, no Q_2 (a third of the step)
        q_pi = agent.critic_1(s if c is None else c, mu)                                      # [B]
    return -q_pi.mean() + residual_l2 * (mu / agent.residual_bound).pow(2).mean(), mu


def td3_update(agent: StepResidualTD3Agent, batch: dict[str, torch.Tensor], actor_opt, critic_opt, cfg,
               train_policy: bool = True) -> dict[str, float]:
    """One critic step on the TD3 target, then (``train_policy``) one actor step and the Polyak step of the
    targets (module docstring).  With ``train_policy`` False only the critics move (warm-up, delayed steps)."""
    device = agent.explore_std.device
    b = {k: v.to(device) for k, v in batch.items()}
    s, s_next = agent.state(b["obs"], b["base"]), agent.state(b["next_obs"], b["next_base"])
    c = agent.critic_state(s, b.get("priv"), b["base"])                                       # [B, C]: s, or the
    c_next = agent.critic_state(s_next, b.get("next_priv"), b["next_base"])                   # simulator's state
    with torch.no_grad():
        eps = (torch.randn_like(b["latent"]) * cfg.td3_target_noise).clamp(-cfg.td3_noise_clip, cfg.td3_noise_clip)
        eps = eps * agent.residual_mask
        r_next = (agent.residual(s_next, target=True) + eps).clamp(-agent.residual_bound, agent.residual_bound)
        y = b["reward"] + b["bootstrap"] * agent.critic(c_next, r_next, target=True).min(0).values  # [B]
    q = agent.critic(c, b["latent"])                                                          # [2, B]
    stats = twin_q_step(q, y, critic_opt, critic_opt.param_groups[0]["params"],  # = value_parameters()
                        cfg.max_grad_norm, "a TD3 step")
    if train_policy:
        loss, mu = actor_loss(agent, s, cfg.residual_l2, c)
        actor_opt.zero_grad(set_to_none=True)
        loss.backward()
        require_finite(nn.utils.clip_grad_norm_(actor_opt.param_groups[0]["params"], cfg.max_grad_norm),  # = policy_parameters()
                       "the residual actor's gradient norm", "a TD3 step", "lower actor_lr")
        actor_opt.step()
        stats.update({"policy_loss": loss.item(), "residual_rms": mu.pow(2).mean().sqrt().item()})
    agent.update_targets(cfg.target_tau, actor=train_policy)  # Q_bar follows Q in the warm-up too
    return stats


def optimizers(agent: StepResidualTD3Agent, cfg):
    """``(actor_opt, critic_opt)``: Adam over the residual actor and over the twin Q, with torch's fused kernel (one
    pass over all tensors; on CPU a third of the ``foreach`` version's time and a fifth of the default loop's, which
    cost a tenth of a small TD3 step; ``benchmarks/td3_update_speed.py``)."""
    return (torch.optim.Adam(agent.policy_parameters(), lr=cfg.actor_lr, fused=True),
            torch.optim.Adam(agent.value_parameters(), lr=cfg.critic_lr, fused=True))


def actor_lr(cfg, env_steps: int) -> float:
    """The actor's learning rate for the updates after ``env_steps`` env steps: ``actor_lr`` ramped linearly from 0
    over the ``actor_lr_warmup_steps`` env steps past ``critic_warmup_steps`` (a learning-rate warm-up as in Goyal
    et al. 2017, here of the actor alone): the first actor steps follow a critic fitted to the stage-1 policy's
    data only, and at full rate they move ``r`` to the bound's half within one iteration.  Measured (docs/stage3.md):
    the ramp shortens the dip that follows and ends on the same plateau."""
    return cfg.actor_lr * _ramp(env_steps - cfg.critic_warmup_steps, cfg.actor_lr_warmup_steps)


def bound_scale(cfg, env_steps: int) -> float:
    """The share of ``residual_bound`` the actor may use in the updates after ``env_steps`` env steps (and in the
    rollouts that follow them): 0 through ``critic_warmup_steps``, then linear to 1 over
    ``residual_bound_warmup_steps``.  A gentler start than ``actor_lr``'s ramp, which delays ``r``'s move by a few
    iterations only (Adam's step is about the rate whatever the gradient's size; measured on PickCube, docs/log/stage3/
    06_step_residual_td3.md): a bound that grows caps how far ``a_b + r`` may leave the stage-1 policy's actions,
    whose data the critics were fitted on, whatever their first gradients say (``StepResidualAgent.set_bound_scale``)."""
    return _ramp(env_steps - cfg.critic_warmup_steps, cfg.residual_bound_warmup_steps)


def _ramp(steps_past_start: int, length: int) -> float:
    """A linear ramp from 0 to 1 over ``length`` steps past its start, clipped to [0, 1]; 1 throughout when ``length``
    is 0 (no ramp)."""
    if length <= 0:
        return 1.0
    return min(1.0, max(0.0, steps_past_start / length))


def td3_agent(policy, cfg, state_dim: int = 0) -> StepResidualTD3Agent:
    """The per-step residual agent with TD3's critics (``cfg``'s ``ResidualConfig``) over a frozen ``policy``;
    ``cfg.asymmetric_critic`` needs ``state_dim``, the env's state width (``EnvSpec.state_dim``)."""
    return StepResidualTD3Agent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                                tuple(cfg.value_hidden_dims), cfg.residual_bound, tuple(cfg.residual_hidden_dims),
                                correct_gripper=cfg.residual_gripper, act_horizon=cfg.act_horizon, obs_clip=cfg.obs_clip,
                                privileged_dim=privileged_width(cfg, policy.meta, state_dim))


def td3_learner(agent: StepResidualTD3Agent, cfg) -> ReplayLearner:
    """TD3 on the per-step residual: each iteration runs ``rollout_steps x Ta`` env steps of every env into the
    replay, then takes ``replay_updates_per_decision`` critic steps per stored transition (batches of
    ``replay_batch_size``), the actor's every ``td3_policy_delay``-th of them once the iteration starts past
    ``critic_warmup_steps`` (none until the replay holds one batch), at the rate ``actor_lr`` gives, with the bound
    ``bound_scale`` gives."""
    steps = cfg.rollout_steps * agent.act_horizon

    def make_collect(runner, generator):
        collector = StepCollector(agent, runner, generator, cfg.td3_n_step)
        return lambda buffer: collector.collect(buffer, steps)

    def update_step(learner, batch, train_policy, i):
        train_policy = train_policy and (i + 1) % cfg.td3_policy_delay == 0
        return td3_update(agent, batch, learner.actor_opt, learner.critic_opt, cfg, train_policy=train_policy)

    def before_update(learner):
        for group in learner.actor_opt.param_groups:
            group["lr"] = actor_lr(cfg, learner.runner.env_steps)
        agent.set_bound_scale(bound_scale(cfg, learner.runner.env_steps))
        if not agent.critic_state_fitted:  # once, on the first iteration's states
            agent.fit_critic_normalizer(learner.buffer.data["priv"][:len(learner.buffer)])

    return ReplayLearner(agent, cfg, replay_buffer(agent, cfg.replay_size), make_collect, update_step, optimizers,
                         lambda num_envs: steps * num_envs, "residual TD3", before_update=before_update,
                         after_update=lambda learner: {"actor_lr": learner.actor_opt.param_groups[0]["lr"],
                                                       "bound_scale": agent.bound_scale.item()})
