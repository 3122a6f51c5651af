"""PPO on the per-step residual (learner ``"ppo"`` of steer ``"residual_step"``; ``flowlib.methods.residual_step``).

The same frozen flow, state ``s = (o_t, a_b)`` and bounded mean ``mu_phi(s)`` as TD3's, but the policy is the
Gaussian ``r ~ N(mu_phi(s), sigma^2 I)`` (``sigma`` the scheduled exploration std, ``r`` unclipped), the critic a
state value ``V_psi(s)``, and every env step is a decision of ``learners.PPOLearner``: GAE over env steps with
``gamma`` per step, the clipped surrogate of ``flowlib.rl.ppo`` (Schulman et al. 2017, Eq. 7), its log-prob ``A``
Gaussian dims against a chunk decision's hundreds through the chain.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from flowlib.flows.distributions import gaussian_entropy, gaussian_log_prob
from flowlib.flows.nets import mlp
from flowlib.methods.residual_step import StepCollector, StepResidualAgent
from flowlib.rl.asymmetric import privileged_width
from flowlib.rl.buffers import RolloutBuffer
from flowlib.rl.learners import PPOLearner


class StepResidualPPOAgent(StepResidualAgent):
    """The per-step residual learned on-policy by PPO (learner ``"ppo"``; module docstring).  The same frozen flow,
    state ``s = (o_t, a_b)`` and bounded mean ``mu_phi(s)`` as TD3's, but the policy is the Gaussian
    ``r ~ N(mu_phi(s), sigma^2 I)`` on the dims ``r`` acts on, with ``sigma`` the scheduled ``max_noise_std`` (not
    learned) and ``r`` not clipped, so that its density is exact; the critic is a state value ``V_psi(s)``
    (``value_hidden_dims``).  Every env step is a decision: ``score_rollout`` turns the collector's steps into the
    ``RolloutBuffer`` that ``learners.PPOLearner``'s GAE reads, with the state ``s`` in place of the observation window
    and ``r`` as a one-row chain ``[1, A]``, and ``ppo_view`` is what ``flowlib.rl.ppo.ppo_update`` scores them with."""

    CLIP_EXPLORATION = False  # r is drawn unclipped, so the Gaussian density PPO scores is exact

    def _build_critics(self, hidden: tuple[int, ...]) -> None:  # V(c): c = s, or (state, a_b) when asymmetric
        self.state_value = mlp([self.critic_dim, *hidden, 1], act=nn.Mish)

    def value_parameters(self):
        return list(self.state_value.parameters())

    def residual_log_probs(self, s: torch.Tensor, chains: torch.Tensor, stochastic: torch.Tensor | None = None):
        """``log N(r; mu_phi(s), sigma^2 I)`` over the dims ``r`` acts on, ``[B, 1]``, for ``r = chains[:, 0]``
        (``chains [B, 1, A]``), and the Gaussian's entropy per dim ``[B]`` (a constant: ``sigma`` is scheduled)."""
        acts = self.residual_mask.bool()                                                      # [A]
        r, mu = chains[:, 0, acts], self.residual(s)[:, acts]                                 # [B, A'] each
        sigma = self.explore_std.expand_as(r)
        return gaussian_log_prob(r, mu, sigma)[:, None], gaussian_entropy(sigma)

    def joint_log_prob(self, step_log_probs: torch.Tensor, stochastic: torch.Tensor, chains: torch.Tensor):
        """``[B, 1] -> [B]``: ``r``'s log-density where it was drawn (one Gaussian per decision, summed over its dims)."""
        return step_log_probs[:, 0] * stochastic[:, 0].to(step_log_probs.dtype)

    def ppo_view(self) -> "_PPOView":
        return _PPOView(self)

    @torch.no_grad()
    def score_rollout(self, steps: dict[str, torch.Tensor]) -> RolloutBuffer:
        """``StepCollector``'s env steps (each field ``[T, N, ...]``) as a ``RolloutBuffer`` of decisions: ``obs`` the
        state ``s``, ``chains`` ``r [1, A]`` and its log-prob (the policy has not moved since it drew ``r``), ``V(s)``,
        ``V(s')``, and ``discounts`` = ``bootstrap`` = ``gamma (1 - terminal)`` (``gamma > 0``: only a termination
        zeroes it).  An asymmetric ``V`` (``privileged_dim``) reads ``c = critic_state(s, state, a_b)`` instead, kept as
        the buffer's ``states``; its normaliser is fitted on the first rollout's states."""
        device = self.explore_std.device
        T, N = steps["reward"].shape
        if not self.critic_state_fitted:
            self.fit_critic_normalizer(steps["priv"].flatten(0, 1))

        def state(obs, base):  # [T, N, To, O], [T, N, A] -> [T*N, S]
            return self.state(obs.flatten(0, 1).to(device), base.flatten(0, 1).to(device))

        def per_env(x):  # [T*N, ...] -> [T, N, ...] on the CPU
            return x.reshape(T, N, *x.shape[1:]).cpu()

        s, s_next = state(steps["obs"], steps["base"]), state(steps["next_obs"], steps["next_base"])
        chains = steps["latent"].flatten(0, 1)[:, None].to(device)                           # [T*N, 1, A]
        stochastic = torch.ones(T * N, 1, dtype=torch.bool, device=device)
        step_lp, _ = self.residual_log_probs(s, chains, stochastic)
        log_prob = self.joint_log_prob(step_lp, stochastic, chains)                          # [T*N]
        c, c_next = s, s_next
        if self.privileged_dim:  # [T*N, P + A]
            c = self.critic_state(s, steps["priv"].flatten(0, 1).to(device), steps["base"].flatten(0, 1).to(device))
            c_next = self.critic_state(s_next, steps["next_priv"].flatten(0, 1).to(device),
                                       steps["next_base"].flatten(0, 1).to(device))
        value, next_value = self.state_value(c)[:, 0], self.state_value(c_next)[:, 0]      # [T*N]
        return RolloutBuffer(obs=per_env(s), chains=per_env(chains), stochastic=per_env(stochastic),
                             step_log_probs=per_env(step_lp), log_probs=per_env(log_prob), values=per_env(value),
                             rewards=steps["reward"], discounts=steps["bootstrap"], next_values=per_env(next_value),
                             terminal=steps["bootstrap"] == 0, ends=steps["end"], weights=torch.ones(T, N),
                             states=per_env(c) if self.privileged_dim else None)


class _PPOView:
    """What ``flowlib.rl.ppo.ppo_update`` reads of an agent, for the per-step residual's decisions: ``obs`` is the state
    ``s``, ``value`` is ``V_psi(s)`` (an asymmetric one's: ``V_psi(c)``, ``c`` the batch's ``states``), a chain is
    ``r [1, A]``."""

    def __init__(self, agent: StepResidualPPOAgent):
        self.agent = agent
        self.parameters, self.policy_parameters = agent.parameters, agent.policy_parameters
        self.value_parameters, self.joint_log_prob = agent.value_parameters, agent.joint_log_prob
        self.step_log_probs = agent.residual_log_probs

    def value(self, s: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:  # [B, S] (, [B, C]) -> [B]
        return self.agent.state_value(s if c is None else c).squeeze(-1)


def step_ppo_agent(policy, cfg, state_dim: int = 0) -> StepResidualPPOAgent:
    """The per-step residual agent that PPO learns (``cfg``'s ``ResidualConfig``) over a frozen stage-1/2 ``policy``;
    ``state_dim``: the env's state width, which ``V`` reads with ``asymmetric_critic`` (``flowlib.rl.asymmetric``)."""
    return StepResidualPPOAgent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                                tuple(cfg.value_hidden_dims), cfg.residual_bound, tuple(cfg.residual_hidden_dims),
                                correct_gripper=cfg.residual_gripper, act_horizon=cfg.act_horizon, obs_clip=cfg.obs_clip,
                                privileged_dim=privileged_width(cfg, policy.meta, state_dim))


def step_ppo_learner(agent: StepResidualPPOAgent, cfg) -> PPOLearner:
    """PPO on the per-step residual: every env step a decision (``StepCollector.rollout``), scored through
    ``ppo_view``."""
    def make_rollout(agent, runner, generator):
        collector = StepCollector(agent, runner, generator, n_step=0)
        return lambda: collector.rollout(cfg.rollout_steps * agent.act_horizon)

    return PPOLearner(agent, cfg, make_rollout, scorer=agent.ppo_view(), name="residual PPO")
