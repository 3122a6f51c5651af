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

Learner ``"ppo"`` (``StepResidualPPOAgent``) learns the same correction on-policy instead: the policy is the Gaussian
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

import copy
import time

import torch
import torch.nn as nn

from flowlib.rl.asymmetric import CriticStateNorm, privileged_width
from flowlib.rl.buffers import ReplayBuffer, RolloutBuffer
from flowlib.flows.flow_sde import gaussian_entropy, gaussian_log_prob
from flowlib.rl.learners import PPOLearner
from flowlib.flows.nets import TwinQ, mlp
from flowlib.envs.smdp import ChunkRunner
from flowlib.methods.steering import FlowSteer, steer_options


class StepResidualAgent(CriticStateNorm, FlowSteer):
    """The frozen flow (its deterministic chain from ``x_0 ~ N(0, I)`` proposes each chunk) plus the residual actor
    ``mu_phi(o, a_b)``, its TD3 twin critics ``Q(o, a_b, r)`` and the Polyak targets of both (module docstring).
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
    CLIP_EXPLORATION = True  # TD3 stores the clipped draw; PPO's subclass scores an unclipped one
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
        """TD3's twin critics ``Q(s, r)`` and the Polyak targets of the critics and the actor."""
        self.residual_target = copy.deepcopy(self.residual_net).requires_grad_(False)
        self.q = TwinQ(self.critic_dim, self.action_dim, hidden)
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)

    # parameter groups
    def policy_parameters(self):
        return list(self.residual_net.parameters())

    def value_parameters(self):
        return list(self.q.parameters())

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


class NStepReturns:
    """Turns the collector's one-step transitions into ``n``-step ones (Sutton & Barto 2018, Eq. 7.1; as in D4PG and
    Rainbow, without an off-policy correction), so that a reward reaches the critic's target ``n`` steps earlier
    than through ``n`` bootstraps::

        R = sum_{k<m} (prod_{j<k} g_j) r_{t+k},   bootstrap = prod_{j<m} g_j,   s' = s_{t+m}

    ``g_j`` = ``gamma (1 - terminal)`` of step ``t + j``, ``m = n``, or fewer where the episode ends inside the
    window (a termination zeroes the bootstrap, a truncation keeps ``gamma^m`` and bootstraps from the last window)
    or where ``flush`` cuts it.  All envs step together, so a window is the last ``n`` steps' ``[N, ...]`` rows:
    ``push`` returns the oldest step's ``n``-step rows once ``n`` steps are pending, ``flush`` all pending ones
    (the rollout was broken off: the runner restarted its episodes).  ``n = 1`` passes each step through."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"td3_n_step must be >= 1, got {n}")
        self.n, self.pending = n, []

    def push(self, **step: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """``step``: one env step's rows of every replay field plus ``end [N]`` (the episode ended there)."""
        if self.n == 1:  # the default, on the rollout's hot path: nothing to sum (0.2 ms a step saved)
            step.pop("end")
            return [step]
        self.pending.append(step)
        return [self._pop()] if len(self.pending) == self.n else []

    def flush(self) -> list[dict[str, torch.Tensor]]:
        return [self._pop() for _ in range(len(self.pending))]

    def _pop(self) -> dict[str, torch.Tensor]:
        steps, first = self.pending, self.pending[0]
        r = torch.stack([s["reward"] for s in steps])                                   # [L, N]
        g = torch.stack([s["bootstrap"] for s in steps])                                # [L, N]
        end = torch.stack([s["end"] for s in steps]).long()                             # [L, N]
        before = torch.cumprod(torch.cat([torch.ones_like(g[:1]), g[:-1]]), 0)          # prod_{j<k} g_j
        inside = (end.cumsum(0) - end) == 0                                             # no end before step k
        last = torch.where(end.any(0), end.argmax(0), len(steps) - 1)                   # [N]: step m - 1
        envs = torch.arange(len(last))
        out = {k: v for k, v in first.items() if k in ("obs", "latent", "base", "priv")}
        out["reward"] = (inside * before * r).sum(0)
        out["bootstrap"] = (before * g)[last, envs]
        for k in [k for k in first if k.startswith("next_")]:  # next_obs, next_base (and next_priv)
            out[k] = torch.stack([s[k] for s in steps])[last, envs]
        self.pending = steps[1:]
        return out


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
