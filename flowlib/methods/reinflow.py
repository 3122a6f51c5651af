"""ReinFlow (Zhang et al. 2025): PPO fine-tuning of a flow policy through its noisy denoising chain.

The agent (``flowlib.methods.reinflow_agent``: the denoising MDP, the noise net and the chain's exact log-likelihood,
ReinFlow Eq. 4-5) is trained by ``flowlib.rl.learners.PPOLearner`` in ``flowlib.rl.loop``'s loop; this module is what is
the chain's own: its options (``ChainConfig``), its rollouts (``collect``, with branches), Monte-Carlo values of a
state under the noisy policy (``finish_episodes``) and the likelihood-ratio gradient (``policy_gradient``).

Chunks as a semi-MDP
--------------------
One decision executes ``act_horizon`` actions.  It earns ``R = sum_{k<tau} gamma^k r_{t+k}`` and
bootstraps with ``gamma^tau`` (``tau < act_horizon`` when the episode ends inside the chunk).  A
termination stops the bootstrap; a truncation (time limit) bootstraps from ``V`` of the last
observation (``flowlib.envs.smdp.ChunkRunner`` steps the envs).  GAE runs over decisions with per-decision
discount ``gamma^tau``.

Everything here acts on normalised actions (the flow's space, roughly ``[-1, 1]``); the policy's
normalisers map to and from the env.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flowlib.envs.smdp import ChunkRunner
from flowlib.flows.flow_sde import METHODS
from flowlib.infra.config import Fraction, NonNegativeFloat
from flowlib.infra.runs import policy_checkpoint
from flowlib.methods.reinflow_agent import LOG_PROB_OVER, LOG_PROB_REDUCE, ReinFlowAgent
from flowlib.policies.awsc import load_from_aw_shortcut_flow
from flowlib.rl.asymmetric import privileged_width
from flowlib.rl.buffers import RolloutBuffer
from flowlib.rl.learners import PPOLearner, decisions_per_iteration

CRITIC_INPUTS = ("obs", "velocity_features")


@dataclass
class ChainConfig:
    """The noisy chain's options (steer ``"chain"``): what carries noise, and how the chain is scored."""

    noise_method: str = "reinflow"  # reinflow / flow_noise (learned std) / flow_sde / flow_cps (noise_level a)
                                    # [toolkit: noise_*]
    noise_level: NonNegativeFloat = 0.5  # a of flow_sde / flow_cps; scaled by the noise schedule like max_noise_std
    hybrid: bool = False  # one random stochastic step per sample, the rest ODE (piRL's hybrid ODE-SDE)
    include_initial_noise: bool = False  # log N(x_0; 0, I) in the joint log-prob (flow_noise always has it)
    log_prob_over: str = "chunk"  # the dims each step scores: "chunk" / "executed_last" (exact) or "executed"
    noise_corr: Fraction = 0.0  # correlation of a step's noise along the chunk's H actions, in [0, 1)
    freeze_obs_encoder: bool = False  # keep the velocity net's obs_encoder (stage 1's obs_emb_dim > 0) fixed
    clip_chain_means: bool = False  # clamp each noisy step's mean into the action range (ReinFlow's denoised clip)
    noise_clip: NonNegativeFloat = 0.0  # clip each step's standard normal draw at +-noise_clip sigma (0: off; ReinFlow: 3)
    bc_coeff: NonNegativeFloat = 0.0  # weight of the W2 pull to the start policy in PPO's loss (ReinFlow's; 0: off)
                                      # [toolkit: bc_coeff_1]

    def chain_checks(self) -> list[tuple[bool, str]]:
        return [(self.noise_method in METHODS, f"noise_method must be one of {METHODS}, got {self.noise_method!r}"),
                (self.log_prob_over in LOG_PROB_OVER,
                 f"log_prob_over must be one of {LOG_PROB_OVER}, got {self.log_prob_over!r}"),
                (self.noise_corr < 1, f"noise_corr must be in [0, 1) (0: independent), got {self.noise_corr}")]


@dataclass
class ChunkScoreConfig:
    """How a chunk decision's log-prob and value are computed (the chunk-level PPO steers: chain, latent, residual)."""

    log_prob_reduce: str = "sum"  # "sum" (the exact joint log-prob), "mean" (over steps), "mean_dim" (per dim)
    critic_input: str = "obs"  # V reads "obs" (the window) or "velocity_features" (the velocity net's features)
                               # [toolkit: critic_velocity]
    detach_critic_input: bool = True  # velocity_features: the value loss does not reach the velocity net
                                      # [toolkit: critic_velocity_grad]

    def score_checks(self) -> list[tuple[bool, str]]:
        return [(self.log_prob_reduce in LOG_PROB_REDUCE,
                 f"log_prob_reduce must be one of {LOG_PROB_REDUCE}, got {self.log_prob_reduce!r}"),
                (self.critic_input in CRITIC_INPUTS,
                 f"critic_input must be one of {CRITIC_INPUTS}, got {self.critic_input!r}")]


def chain_agent(policy, cfg, state_dim: int = 0) -> ReinFlowAgent:
    """The ReinFlow agent of ``cfg`` (steer ``"chain"``) over a stage-1/2 ``policy``; ``state_dim``: the env's state
    width, which ``V`` reads with ``asymmetric_critic`` (``flowlib.rl.asymmetric``)."""
    return ReinFlowAgent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                         tuple(cfg.value_hidden_dims), noise_level=cfg.noise_level,
                         freeze_obs_encoder=cfg.freeze_obs_encoder, **score_options(cfg),
                         include_initial_noise=cfg.include_initial_noise, log_prob_over=cfg.log_prob_over,
                         noise_method=cfg.noise_method, hybrid=cfg.hybrid, noise_corr=cfg.noise_corr,
                         clip_chain_means=cfg.clip_chain_means, noise_clip=cfg.noise_clip,
                         privileged_dim=privileged_width(cfg, policy.meta, state_dim))


def score_options(cfg) -> dict:
    """The agent options every chunk-level PPO steer shares (``ChunkScoreConfig`` and the run's)."""
    return dict(log_prob_reduce=cfg.log_prob_reduce, critic_input=cfg.critic_input,
                detach_critic_input=cfg.detach_critic_input, act_horizon=cfg.act_horizon, obs_clip=cfg.obs_clip)


def chunk_rollout(cfg):
    """``PPOLearner``'s ``make_rollout`` for a chunk-level steer: ``collect`` of the iteration's decisions (one
    episode per env, without auto-reset, for GRPO; ``branches`` chains per state for the branch advantage)."""
    def make(agent, runner: ChunkRunner, generator: torch.Generator):
        decisions, grpo = decisions_per_iteration(cfg, agent.act_horizon), cfg.advantage == "grpo"
        return lambda: collect(agent, runner, decisions, generator, auto_reset=not grpo, branches=cfg.branches)
    return make


def chunk_ppo(agent, cfg, name: str = "ReinFlow", regularisers=()) -> PPOLearner:
    """PPO on chunk decisions (``collect``), for the chain and for the steers that score one Gaussian per chunk."""
    return PPOLearner(agent, cfg, chunk_rollout(cfg), name=name, regularisers=regularisers)


def chain_ppo(agent: ReinFlowAgent, cfg) -> PPOLearner:
    """Chain ReinFlow's learner: ``chunk_ppo``, with ``W2Regulariser`` to the start policy when ``bc_coeff > 0``."""
    regularisers = []
    if cfg.bc_coeff > 0:
        start_policy, _ = load_from_aw_shortcut_flow(policy_checkpoint(cfg.init_checkpoint, "init_checkpoint"))
        regularisers.append(W2Regulariser(agent, chain_agent(start_policy, cfg), cfg.bc_coeff))
    return chunk_ppo(agent, cfg, "ReinFlow", regularisers)


class W2Regulariser:
    """ReinFlow's behaviour-cloning regulariser (its ``bc_loss_type: W2``): PPO's loss gains

        coeff * E_{x_0 ~ N(0, I)} || f_theta(s, x_0) - f_start(s, x_0) ||^2 / (H A)

    where ``f(s, x_0)`` is a flow's deterministic chunk (``ReinFlowAgent.ode_chunk``, normalised units) and
    ``f_start`` the frozen start policy (the stage-1/2 checkpoint the run began from, read again from
    ``init_checkpoint`` so a resumed run pulls to the same place).  Both flows map the same ``x_0``: that coupling's
    cost is an upper bound on ``W_2^2`` between the two policies' chunk distributions (the optimal coupling costs
    no more), so the term keeps the whole distribution near the start, not only its mode.  It is 0 at the start
    and grows as PPO moves the velocity net; the noise net is not reached by it.  ``distance(obs [b, To, O],
    generator) -> [b]``: the squared distances; ``ppo.ppo_update`` weighs their mean over a minibatch by ``coeff``."""

    name = "bc_loss"  # its column in the log

    def __init__(self, agent: ReinFlowAgent, start: ReinFlowAgent, coeff: float):
        self.agent, self.start, self.coeff = agent, start.eval().requires_grad_(False), float(coeff)

    def weights(self, batch: dict, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w  # every live decision

    def __call__(self, batch: dict, rows: torch.Tensor, weights: torch.Tensor,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        return (self.distance(batch["obs"][rows], generator) * weights).sum()

    def distance(self, obs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        a = self.agent
        x0 = torch.randn(len(obs), a.pred_horizon, a.action_dim, generator=generator).to(obs.device)
        self.start.to(obs.device)
        with torch.no_grad():
            target = self.start.ode_chunk(obs, x0)                           # [b, H, A]
        return (a.ode_chunk(obs, x0) - target).pow(2).mean((1, 2))          # [b]


@torch.no_grad()
def collect(agent: ReinFlowAgent, runner: ChunkRunner, num_decisions: int,
            generator: torch.Generator | None = None, auto_reset: bool = True, branches: int = 1) -> RolloutBuffer:
    """``num_decisions`` chunk decisions of every env with the noisy chain (ReinFlow Alg. 1, rollout).

    ``V`` is evaluated once per window: the value after a chunk is the next decision's value, except
    in envs that ended and were reset.  The buffer's ``policy_time`` is the policy's share of the wall time.
    With ``auto_reset=False`` (GRPO) an env whose episode ended idles, and its later rows get weight 0.
    ``branches = M >= 2``: every decision tries ``M`` chains from the same env state (``step_branches``),
    drawn from one shared ``x_0`` (common random numbers; ``x_0`` is not what the branch advantage scores);
    the buffer is ``[T, M * N]``, branch ``m`` of env ``i`` in column ``m * N + i``.

    An asymmetric ``V`` (``agent.privileged_dim``; ``flowlib.rl.asymmetric``) reads the simulator's state, not the
    window: the buffer keeps each decision's state and the state after it (``states``, ``next_states``) and the
    values are computed from them at the end, in one batch, after the first rollout has fitted V's state normaliser.
    """
    if branches > 1:
        return _collect_branches(agent, runner, num_decisions, generator, branches)
    device = next(agent.parameters()).device
    asymmetric = getattr(agent, "privileged_dim", 0) > 0
    rows, policy_time, value = [], 0.0, None
    for _ in range(num_decisions):
        tp = time.time()
        window, weight, state = runner.window.to(device), runner.active.float(), runner.privileged.clone()
        chain, log_prob, stochastic, step_lp = agent.sample(window, generator, return_steps=True)
        if value is None and not asymmetric:
            value = agent.value(window)
        actions = agent.actions(chain).cpu()
        policy_time += time.time() - tp
        out = runner.step_chunk(actions, auto_reset)
        tp = time.time()
        if asymmetric:  # valued below, from the states
            value = next_value = value_after = torch.zeros(len(window))
        else:
            next_value = agent.value(out["next_window"].to(device))  # V(s_{t+tau}); for an ended env, its last window
            value_after = next_value.clone()
            if auto_reset and out["end"].any():
                end = out["end"].to(device)
                value_after[end] = agent.value(runner.window.to(device)[end])  # the reset envs' first windows
        policy_time += time.time() - tp
        rows.append(_row(window, chain, stochastic, step_lp, log_prob, value, weight, out, next_value))
        if asymmetric:
            rows[-1] |= {"states": state, "next_states": out["next_privileged"]}
        value = value_after
    buf = RolloutBuffer(**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}, policy_time=policy_time)
    if asymmetric:
        tp = time.time()
        value_states(agent, buf)
        buf.policy_time += time.time() - tp
    return buf


@torch.no_grad()
def value_states(agent: ReinFlowAgent, buf: RolloutBuffer) -> None:
    """An asymmetric ``V``'s ``values`` and ``next_values`` of ``buf`` from its ``states`` / ``next_states``
    ``[T, N, P]``; its state normaliser is fitted first, on this rollout's live states, if it is not yet."""
    if not agent.critic_state_fitted:
        agent.fit_critic_normalizer(buf.states[buf.weights > 0])
    device = next(agent.parameters()).device
    for states, field in ((buf.states, "values"), (buf.next_states, "next_values")):
        v = agent.value(None, states.flatten(0, 1).to(device))
        setattr(buf, field, v.reshape(states.shape[:2]).cpu())


def _row(window, chain, stochastic, step_lp, log_prob, value, weight, out, next_value) -> dict[str, torch.Tensor]:
    """One decision's row of a ``RolloutBuffer`` (on the CPU), from the sample and ``step_chunk``'s ``out``."""
    return {"obs": window.cpu(), "chains": chain.cpu(), "stochastic": stochastic.cpu(), "step_log_probs": step_lp.cpu(),
            "log_probs": log_prob.cpu(), "values": value.cpu(), "weights": weight, "rewards": out["reward"],
            "discounts": out["discount"], "next_values": next_value.cpu(), "terminal": out["terminal"], "ends": out["end"]}


def _collect_branches(agent: ReinFlowAgent, runner: ChunkRunner, num_decisions: int,
                      generator: torch.Generator | None, M: int) -> RolloutBuffer:
    device = next(agent.parameters()).device
    N = runner.env.num_envs
    rows, policy_time = [], 0.0
    for _ in range(num_decisions):
        tp = time.time()
        window = runner.window.to(device)                                          # [N, To, O]
        x0 = torch.randn(N, agent.pred_horizon, agent.action_dim, generator=generator).repeat(M, 1, 1)
        windows = window.repeat(M, 1, 1)                                           # [M*N, To, O]
        chain, log_prob, stochastic, step_lp = agent.sample(windows, generator, return_steps=True, x0=x0)
        value = agent.value(window).repeat(M)
        actions = agent.actions(chain).cpu().reshape(M, N, agent.act_horizon, -1)  # [M, N, Ta, A]
        policy_time += time.time() - tp
        outs = runner.step_branches(actions)
        tp = time.time()
        out = {k: torch.cat([o[k] for o in outs]) for k in ("reward", "discount", "terminal", "end", "next_window")}
        next_value = agent.value(out["next_window"].to(device))  # V(s'_m); for an ended env, its last window
        policy_time += time.time() - tp
        rows.append(_row(windows, chain, stochastic, step_lp, log_prob, value, torch.ones(M * N), out, next_value))
    return RolloutBuffer(**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}, policy_time=policy_time)


@torch.no_grad()
def finish_episodes(agent: ReinFlowAgent, runner: ChunkRunner, generator: torch.Generator | None = None
                    ) -> torch.Tensor:
    """Monte-Carlo value of each env's current state under the noisy policy: run every active episode to
    its end (no reset) and return ``G [N]`` = sum_k gamma^k r_k (as learning sees the reward), plus
    ``gamma^t V(s_t)`` where the time limit ends it, as the critic's targets bootstrap; 0 for an env that
    has already ended.  ``E[G] = V^pi(s)`` is what the critic estimates (``benchmarks/branch_calibration.py``)."""
    device = next(agent.parameters()).device
    total, discount = torch.zeros(runner.env.num_envs), torch.ones(runner.env.num_envs)
    while runner.active.any():
        chain = agent.sample(runner.window.to(device), generator)[0]
        out = runner.step_chunk(agent.actions(chain).cpu(), auto_reset=False)   # ended envs: reward 0, discount 1
        truncated = out["end"] & ~out["terminal"]
        v = (agent.value(None, out["next_privileged"].to(device)) if getattr(agent, "privileged_dim", 0)
             else agent.value(out["next_window"].to(device)))
        tail = torch.where(truncated, v.cpu(), 0.0)
        total += discount * (out["reward"] + out["discount"] * tail)
        discount *= out["discount"]
    return total


def policy_gradient(agent: ReinFlowAgent, obs: torch.Tensor, chains: torch.Tensor, stochastic: torch.Tensor,
                    advantages: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """The flat gradient ``[P]`` of ``-mean_i A_i log pi(chain_i | s_i)`` with respect to ``params``.

    ``obs [B, To, O]``, ``chains [B, K+1, H, A]``, ``stochastic [B, K]``, ``advantages [B]``.  This is the
    likelihood-ratio policy gradient (Williams 1992) of the denoising MDP, with the chain's log-likelihood of
    ReinFlow Eq. 5: the gradient of the PPO surrogate (Schulman et al. 2017, Eq. 7) on the first minibatch
    of an update, where every ratio is 1 (before advantage normalisation, which the caller does or not).
    ``agent`` is what ``ppo_update`` scores with (a per-step residual's ``ppo_view()``: ``obs`` the states
    ``s [B, S]``, ``chains`` ``r [B, 1, A]``).  A parameter that the log-prob does not reach gets a zero gradient."""
    stochastic = stochastic.to(chains.device)
    step_lp, _ = agent.step_log_probs(obs, chains, stochastic)
    log_prob = agent.joint_log_prob(step_lp, stochastic, chains)
    grads = torch.autograd.grad(-(advantages * log_prob).mean(), params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)])
