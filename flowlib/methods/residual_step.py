"""Per-step residual RL: a closed-loop correction of every executed action, learned off-policy (TD3) or by PPO.

``flowlib.methods.residual`` corrects a chunk's ``Ta`` actions once per decision, from the observation at the chunk's
start: open loop for 8 env steps.  Residual Policy Learning (Silver et al. 2018) corrects a base controller at
every step, from the current observation, and learns the correction off-policy (DDPG there).  Here the base is
the frozen stage-1 flow, whose chunk still runs open loop, and the correction closes the loop around it::

    every Ta steps:   x_0 ~ N(0, I),  chunk = ODE_theta(x_0 | o)      (the frozen flow, K Euler steps)
    at step j of the chunk:   a_b = chunk[j]                           (normalised action units)
                              r = mu_phi(o_t, a_b),  |r| <= b          (b tanh of an MLP: the residual actor)
                              a_t = a_b + r                            (runs; a_b alone = the stage-1 policy)

The residual's state is ``s = (o_t, a_b)``: the observation window and the base action due now, so the next
state's ``a_b'`` is the chunk's next action (or the first of the next chunk).  Each env step is one transition
``(s, r, reward, s')`` of an ordinary MDP (``gamma`` per step), and TD3 (Fujimoto et al. 2018) learns it from a
replay buffer: twin critics ``Q_1, Q_2 (s, r)`` on the clipped double-Q target with target-policy smoothing
(their Eq. 15)::

    y = reward + gamma (1 - terminal) min_j Q_bar_j(s', clip(mu_bar(s') + clip(eps, -c, c), -b, b)),
    eps ~ N(0, td3_target_noise^2)

(with ``td3_n_step`` = n > 1: ``sum_{k<m} gamma^k reward_{t+k} + gamma^m (1 - terminal) min_j Q_bar_j(s_{t+m}, ...)``,
``NStepReturns``) and, every ``td3_policy_delay`` critic steps, the deterministic policy gradient ``max_phi Q_1(s, mu_phi(s))``
(their Alg. 1) and the Polyak step of ``mu_bar``; ``Q_bar`` takes its Polyak step after every critic step, the
warm-up's included (a target left at its random start would be what the warm-up fits).  Exploration adds ``N(0, sigma^2)`` to ``r``
(``sigma`` = ``max_noise_std``, clipped to the bound).  ``mu_phi``'s last layer starts at zero: before any actor
step the deterministic policy is the stage-1 policy exactly, episode for episode.

Learner ``"td3"`` is ``flowlib.methods.residual_td3`` (``StepResidualTD3Agent``).  Learner ``"ppo"``
(``flowlib.methods.residual_step_ppo``, ``StepResidualPPOAgent``) learns the same correction on-policy instead: the policy is the Gaussian
``r ~ N(mu_phi(s), sigma^2 I)`` (``sigma`` the scheduled exploration std, ``r`` unclipped), the critic a state value
``V_psi(s)``, and every env step is a decision of ``learners.PPOLearner`` (GAE over env steps with ``gamma`` per
step; the clipped surrogate of ``flowlib.rl.ppo``, Schulman et al. 2017, Eq. 7), its log-prob ``A`` Gaussian dims (the
arm's 3 when the gripper is left to the base) against a chunk decision's hundreds through the chain.

Why per step: in 200 held-out PickCube episodes the stage-1 policy grasps the cube 0.90 of the time but places it
0.58, hovering a few centimetres from the goal (docs/stage3.md).  A hand-written per-step correction,
``0.3 obj_to_goal / 0.1 m`` while grasped, lifts it to 0.88 on the same episodes: what the base lacks is a
closed-loop last few centimetres, which a once-per-chunk correction cannot provide.

Evaluation (``flowlib.policies.bc.evaluate``, ``flowlib.tools.evaluate``) runs the base chunk as for stage 1 and calls
``correct_step`` on each executed action with the current window; ``--noisy`` adds the exploration noise.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from flowlib._moved import moved_names
from flowlib.envs.smdp import ChunkRunner
from flowlib.flows.nets import mlp
from flowlib.methods.steering import FlowSteer, steer_options
from flowlib.rl.asymmetric import CriticStateNorm
from flowlib.rl.buffers import NStepReturns, ReplayBuffer, RolloutBuffer


class StepResidualAgent(CriticStateNorm, FlowSteer):
    """The frozen flow (its deterministic chain from ``x_0 ~ N(0, I)`` proposes each chunk) plus the residual actor
    ``mu_phi(o, a_b)`` (module docstring).  Its learner brings the critics: ``StepResidualTD3Agent``
    (``flowlib.methods.residual_td3``: twin ``Q(o, a_b, r)`` and the Polyak targets) or ``StepResidualPPOAgent``
    (``flowlib.methods.residual_step_ppo``: ``V(o, a_b)``); ``isinstance(agent, StepResidualAgent)`` holds for both.
    ``residual_bound`` is ``b``; ``max_noise_std`` the exploration std of ``r``; ``residual_hidden`` the actor's
    hidden sizes, ``value_hidden_dims`` the critics'.  ``correct_gripper`` False keeps ``r``, its exploration and its
    target smoothing at 0 on the last action dim (the gripper), which then runs as the base commands it.
    ``min_noise_std`` is not read (the std is the schedule's, not learned); it stays in the signature of the
    steers.

    ``privileged_dim`` ``P`` > 0 makes the critics asymmetric (Pinto et al. 2018, Sec. IV): ``Q(c, r)`` reads
    ``c = [the simulator's state (P dims, normalised), a_b]`` (``critic_state``) while the actor still reads
    ``s = (o_t, a_b)``, the camera's embedding: the critic is only needed in training, where the simulator's state
    is at hand, and the object's pose that the frozen encoder may not hold is what the value depends on.  The state
    is normalised by its mean and std over the first transitions the critics see (``fit_critic_normalizer``; kept in
    the checkpoint)."""

    closed_loop = True  # flowlib.policies.bc.evaluate corrects each executed action (correct_step)
    CLIP_EXPLORATION: bool  # TD3 stores the clipped draw; PPO scores an unclipped one
    LEGACY_DROPPED = ("value_net.",)  # written when this agent carried the chain agent's V, untrained

    def __init__(self, policy, num_inference_steps: int = 8, min_noise_std: float = 0.01, max_noise_std: float = 0.05,
                 value_hidden_dims: tuple[int, ...] = (256, 256), residual_bound: float = 0.5,
                 residual_hidden: tuple[int, ...] = (256, 256), correct_gripper: bool = True, privileged_dim: int = 0,
                 **options):
        why = "steer 'residual_step' runs the flow's ODE; its policy is one Gaussian per env step (no chain log-prob)"
        options = steer_options(options, why)
        if options.get("log_prob_reduce", "sum") != "sum":
            raise ValueError(f"{why}: log_prob_reduce must be 'sum', got {options['log_prob_reduce']!r}")
        if not residual_bound > 0:
            raise ValueError(f"residual_bound must be > 0, got {residual_bound}")
        super().__init__(policy, num_inference_steps, options.get("act_horizon", 0), options.get("obs_clip", 5.0))
        self.residual_bound = float(residual_bound)
        self.state_dim = self.flow.obs_features_dim + self.action_dim  # s = (o window or its embedding, a_b)
        self._init_critic_state(privileged_dim)
        self.critic_dim = self.privileged_dim + self.action_dim if self.privileged_dim else self.state_dim  # c
        self.residual_net = mlp([self.state_dim, *residual_hidden, self.action_dim], act=nn.Mish)
        nn.init.zeros_(self.residual_net[-1].weight)
        nn.init.zeros_(self.residual_net[-1].bias)  # r = 0 at the start: the stage-1 policy
        self._build_critics(tuple(value_hidden_dims))
        self.register_buffer("explore_std", torch.tensor(float(max_noise_std)))
        self.register_buffer("bound_scale", torch.tensor(1.0))  # b's share in force (TD3's residual_bound_warmup_steps)
        mask = torch.ones(self.action_dim)
        if not correct_gripper:
            mask[-1] = 0.0  # ManiSkill's pd_ee_delta_pos: [dx, dy, dz, gripper]
        self.register_buffer("residual_mask", mask, persistent=False)  # [A]: 1 where r may act (from the config)

    def _build_critics(self, hidden: tuple[int, ...]) -> None:
        """The learner's critics, built between the actor and the buffers (the order fixes the initial weights):
        TD3's twin ``Q`` (``StepResidualTD3Agent``) or PPO's ``V`` (``StepResidualPPOAgent``)."""
        raise NotImplementedError("build StepResidualTD3Agent or StepResidualPPOAgent: the learner brings the critics")

    # parameter groups
    def policy_parameters(self):
        return list(self.residual_net.parameters())

    def set_max_noise_std(self, value: float) -> None:
        self.explore_std.fill_(value)

    def set_bound_scale(self, value: float) -> None:
        """The actor's bound becomes ``value * b`` (``0 <= value <= 1``): ``mu_phi = value * b tanh(f_phi)``; the critics
        still read ``r / b`` and exploration still clips to ``b``."""
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"the residual's bound scale must lie in [0, 1], got {value}")
        self.bound_scale.fill_(value)

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        """Also reads a checkpoint written before ``bound_scale`` existed: its actor ran at the full bound."""
        if "bound_scale" not in state:
            state = {**state, "bound_scale": torch.tensor(1.0)}
        return super().load_state_dict(state, strict, assign)

    def state(self, obs_window: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``s = [normalised, clipped o window (flat), a_b]``: raw ``[B, To, O]``, normalised ``[B, A]`` -> ``[B, S]``.
        A visual policy's ``s`` holds the frozen encoder's embedding instead of the window (``obs_window`` may then be
        ``observe``'s output, as the replay stores it; ``FrozenFlow.obs_features``)."""
        return torch.cat([self.flow.obs_features(obs_window), base], 1)

    def critic_state(self, s: torch.Tensor, privileged: torch.Tensor | None, base: torch.Tensor) -> torch.Tensor:
        """What the critics read ``[B, C]``: ``s`` itself, or with ``privileged_dim`` the simulator's state
        ``privileged [B, P]`` normalised (clipped to ``+-obs_clip`` when set) beside ``a_b`` ``base [B, A]``."""
        if not self.privileged_dim:
            return s
        return torch.cat([self.critic_obs(privileged, self.flow.obs_clip), base], 1)

    def residual(self, s: torch.Tensor, target: bool = False) -> torch.Tensor:
        """``mu_phi(s) = b tanh(f_phi(s))`` ``[B, A]``, 0 on the dims it leaves to the base (``target``: the
        Polyak-averaged actor's); times ``bound_scale`` while TD3's bound ramps up (``set_bound_scale``)."""
        bound = self.residual_bound * self.bound_scale
        return bound * torch.tanh((self.residual_target if target else self.residual_net)(s)) * self.residual_mask

    @torch.no_grad()
    def base_chunk(self, obs_window: torch.Tensor, generator: torch.Generator | None = None,
                   x0: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen flow's executed actions in env units ``[B, Ta, A]`` (clipped to the action box), from
        ``x0`` or ``x_0 ~ N(0, I)`` drawn from ``generator``: the stage-1 policy's chunk."""
        o = self.norm_obs(obs_window)
        x0 = self.flow.draw_x0(len(o), generator) if x0 is None else x0
        return self.flow.actions(self.flow.chunk(o, x0))

    @torch.no_grad()
    def act(self, obs_window: torch.Tensor, num_steps: int | None = None, generator: torch.Generator | None = None,
            x0: torch.Tensor | None = None):
        """The base chunk ``[B, Ta, A]`` (``flowlib.policies.bc.evaluate`` then corrects each action with ``correct_step``)."""
        return self.base_chunk(obs_window, generator, x0)

    @torch.no_grad()
    def correct_step(self, obs_window: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """``a_b + r`` in env units ``[B, A]`` for the base action ``action [B, A]`` (env units) due at the window
        ``[B, To, O]``: ``r = mu(s)``, plus ``N(0, sigma^2)`` from ``self.explore`` when that is set (``--noisy``)."""
        base = self.action_normalizer.normalize(action)
        r = self.residual(self.state(obs_window, base))
        if self.explore is not None:
            r = self.explore_noise(r, self.explore)
        return self.action_normalizer.unnormalize(base + r).clamp(-1.0, 1.0)

    def explore_noise(self, r: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``r + N(0, sigma^2)`` on the dims ``r`` acts on, clipped to ``[-b, b]`` when ``CLIP_EXPLORATION`` (TD3)."""
        r = r + self.explore_std * torch.randn(r.shape, generator=generator).to(r.device) * self.residual_mask
        return r.clamp(-self.residual_bound, self.residual_bound) if self.CLIP_EXPLORATION else r

class StepCollector:
    """Runs every env one step at a time.  Every ``Ta`` steps all envs re-plan together (one chain for the batch,
    as stage 1 runs); an env whose episode ended re-plans alone at its reset and joins the common schedule at the
    next boundary (its first chunk is cut short), so a rollout costs about one chain call per ``Ta`` steps plus one
    per ended episode, not one per env and chunk.  It persists across iterations and re-plans every env when the
    runner's windows changed under it (a validation restarts them).  ``n_step`` >= 1 (TD3) turns the steps into
    ``n``-step transitions; 0 (PPO) passes each step on as it ran, with its ``end`` flag."""

    def __init__(self, agent: StepResidualAgent, runner: ChunkRunner, generator: torch.Generator | None = None,
                 n_step: int = 1):
        self.agent, self.runner, self.gen = agent, runner, generator
        # TD3: steps wait here until their n-step return is known; PPO (n_step 0): each step goes on as it is
        self.n_step = NStepReturns(n_step) if n_step else None
        self.chunk, self.phase, self.window = None, 0, None  # [N, Ta, A] normalised, CPU; steps into the common chunk
        self.offset = None  # [N]: where each env's own chunk started, in steps before the common boundary

    def _plan(self, rows: torch.Tensor) -> None:
        """Re-plan ``rows``: the base chunk, normalised once here (not at each of its steps), kept on the CPU."""
        device, norm = self.agent.explore_std.device, self.agent.action_normalizer.normalize
        self.chunk[rows] = norm(self.agent.base_chunk(self.runner.window[rows].to(device), self.gen)).cpu()
        self.offset[rows] = self.phase

    @torch.no_grad()
    def collect(self, buffer: ReplayBuffer, num_steps: int) -> float:
        """``num_steps`` env steps of every env with ``r = agent.explore_noise(mu(s))`` (TD3: clipped to ``+-b``; PPO:
        not), each transition added to ``buffer`` (TD3's replay, or PPO's steps); returns the policy's share of the
        wall time."""
        agent, runner, device = self.agent, self.runner, self.agent.explore_std.device
        N, Ta, A = runner.env.num_envs, agent.act_horizon, agent.action_dim
        tp, policy_time = time.time(), 0.0
        rows, every = torch.arange(N), torch.ones(N, dtype=torch.bool)
        if self.window is None or not torch.equal(self.window, runner.window):
            for row in self.n_step.flush() if self.n_step else []:  # their episodes were broken off
                buffer.add(**row)
            self.chunk, self.offset, self.phase = torch.zeros(N, Ta, A), torch.zeros(N, dtype=torch.long), 0
            self._plan(every)
        policy_time += time.time() - tp
        for _ in range(num_steps):
            tp = time.time()
            window = runner.window.clone()
            privileged = runner.privileged.clone() if agent.privileged_dim else None  # [N, P]: the critic's
            base = self.chunk[rows, self.phase - self.offset]                          # [N, A] normalised, CPU
            base_d = base.to(device)
            observed = agent.observe(window.to(device))  # the window, or a visual policy's embedding
            r = agent.explore_noise(agent.residual(agent.state(observed, base_d)), self.gen)
            action = agent.action_normalizer.unnormalize(base_d + r).clamp(-1.0, 1.0).cpu()
            r = r.cpu()  # the replay buffer lives on the CPU
            policy_time += time.time() - tp
            out = runner.step_chunk(action[:, None])
            tp = time.time()
            self.phase += 1
            # a_b' of an ended episode (truncation bootstraps from it) is its chunk's next action, as if it went on
            next_base = self.chunk[rows, (self.phase - self.offset).clamp(max=Ta - 1)].clone()
            if self.phase == Ta:  # the common boundary: every env re-plans
                self.phase = 0
                self._plan(every)
                next_base[~out["end"]] = self.chunk[~out["end"], 0]  # the ended envs re-planned from their resets too
            elif out["end"].any():
                self._plan(out["end"])
            next_observed = agent.observe(out["next_window"].to(device)).cpu()
            step = dict(obs=observed.cpu(), latent=r, reward=out["reward"], end=out["end"], next_obs=next_observed,
                        bootstrap=out["discount"] * (~out["terminal"]).float(), base=base, next_base=next_base)
            if agent.privileged_dim:  # the asymmetric critic's simulator states
                step.update(priv=privileged, next_priv=out["next_privileged"])
            for row in self.n_step.push(**step) if self.n_step else [step]:
                buffer.add(**row)
            policy_time += time.time() - tp
        self.window = runner.window.clone()
        return policy_time

    def steps(self, num_steps: int) -> tuple[dict[str, torch.Tensor], float]:
        """``num_steps`` env steps of every env as they ran (build the collector with ``n_step = 0``), each field of
        ``collect``'s transitions stacked ``[T, N, ...]``, and the policy's share of the wall time."""
        steps = _Steps()
        policy_time = self.collect(steps, num_steps)
        return {k: torch.stack([row[k] for row in steps]) for k in steps[0]}, policy_time

    def rollout(self, num_steps: int) -> RolloutBuffer:
        """Learner ``"ppo"``: ``num_steps`` env steps of every env, each one decision, as the agent scores them
        (``StepResidualPPOAgent.score_rollout``)."""
        steps, policy_time = self.steps(num_steps)
        t = time.time()
        buf = self.agent.score_rollout(steps)
        buf.policy_time = policy_time + time.time() - t
        return buf


class _Steps(list):
    """A rollout's env steps in order, as ``StepCollector.collect`` adds them (what the replay is for TD3)."""

    def add(self, **row: torch.Tensor) -> None:
        self.append(row)


# where the pieces of this module went when it was split (2026-12-07): old imports still work, with a warning
__getattr__ = moved_names(__name__, {"StepResidualPPOAgent": "flowlib.methods.residual_step_ppo",
                                     "step_ppo_agent": "flowlib.methods.residual_step_ppo",
                                     "step_ppo_learner": "flowlib.methods.residual_step_ppo",
                                     "NStepReturns": "flowlib.rl.buffers"})
