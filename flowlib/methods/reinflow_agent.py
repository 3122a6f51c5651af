"""The noisy denoising chain as a policy (ReinFlow, Zhang et al. 2025): ``ReinFlowAgent`` for every noise method.

The denoising MDP
-----------------
With ``K`` fixed steps on the one grid ``t_k = k / K`` (``flowlib.flows.models.time_grid``), the
deterministic sampler ``x_{k+1} = x_k + v(x_k, t_k) dt`` becomes a Markov chain by adding
learned Gaussian noise at every step (ReinFlow, Eq. 4)::

    x_{k+1} = x_k + v_theta(x_k, t_k | o) dt + sigma_theta(t_k, o) eps_k,     eps_k ~ N(0, I)

so ``pi(x_{k+1} | x_k, o) = N(x_k + v dt, sigma_k^2 I)``.  The chain ``x_0 .. x_K`` is kept and
the log-likelihood of the executed chunk is the sum of the transition log-densities (Eq. 5)::

    log pi(x_{0:K} | o) = log N(x_0; 0, I) [optional]  +  sum_k log N(x_{k+1}; x_k + v_k dt, sigma_k^2 I)

which is exact (no ODE likelihood).  ``sigma`` comes from ``ExploreNoiseNet`` and is squashed into
``[min_noise_std, max_noise_std]``; ``max_noise_std`` decays on a schedule (``flowlib.rl.loop.noise_schedule``).
Evaluation drops the noise: the deterministic chain.

``flowlib.methods.reinflow`` trains this agent with PPO (chunks as a semi-MDP).  The steers (``flowlib.methods.steering``: ``latent``,
``residual``, ``residual_step``) do not use it: they hold the same flow's ODE frozen, plus a head of their own.  Everything here acts on normalised actions (the
flow's space, roughly ``[-1, 1]``); the policy's normalisers map to and from the env.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from flowlib._moved import moved_names
from flowlib.flows.distributions import gaussian_entropy
from flowlib.flows.flow_sde import (
    LEARNED_NOISE,
    check_method,
    clamp_mean,
    full_mask,
    hybrid_mask,
    sample_chain,
    stochastic_steps,
    transition,
)
from flowlib.flows.models import time_grid
from flowlib.flows.nets import ExploreNoiseNet, NoisyVelocityUNet1D, mlp
from flowlib.methods.chain_score import LOG_PROB_OVER, LOG_PROB_REDUCE, ChainScore  # noqa: F401  (re-exported)
from flowlib.policies import chunk_policy
from flowlib.rl.asymmetric import CriticStateNorm

# --------------------------------------------------------------------------- agent


class ReinFlowAgent(CriticStateNorm, chunk_policy.ChunkPolicy):
    """Flow policy (a stage-1/2 ``FlowPolicy``) + noise + value net: the agent of stage 3 for every noise method.

    ``noise_method`` (``flowlib.flows.flow_sde``): ``reinflow`` (learned noise std, ReinFlow Eq. 4),
    ``flow_noise`` (the same, with the initial noise in the joint log-prob, piRL's Flow-Noise),
    ``flow_sde`` (the marginal-preserving SDE, piRL Eq. 8-9) or ``flow_cps`` (coefficient-preserving).
    ``hybrid``: one random stochastic step per sample, the others ODE (piRL's hybrid ODE-SDE).

    ``sample`` runs the chain and returns it (``[B, K+1, H, A]``, normalised) with its joint log-prob
    (and, on request, the ``[B, K]`` mask of stochastic steps); ``step_log_probs`` re-scores stored
    chains step by step under the current weights, on the same grid; ``act`` is the deterministic
    chain (the ODE), in env units.  The flow net trained here is the policy's live net, initialised
    from its EMA weights.

    ``critic_input``: ``obs`` (V on the normalised observation window, piRL's V_vlm analogue) or
    ``velocity_features`` (V on the velocity net's bottleneck features averaged along the deterministic
    chain from ``x_0 = 0``, piRL's V_expert analogue; ``detach_critic_input`` keeps the value loss
    out of the velocity net).

    ``act_horizon``: actions executed per decision (``Ta``); 0 or ``None`` keeps the policy's own.  Fewer
    re-plan more often: more decisions per env step, fewer dims in each executed-action log-prob.

    ``obs_clip``: normalised observations are clipped to ``[-obs_clip, obs_clip]`` (0: off) before the flow,
    noise and value nets see them.  The normaliser's statistics come from the demonstrations, where some dims
    barely move (the cube's and the gripper's tilt: std 0.0003-0.004); an RL rollout that tips the cube puts
    them at 100+ std, where V extrapolates to |V| ~ 10^4 and its targets wreck the critic and the advantages.

    ``noise_corr`` (``rho``): each step's noise is equicorrelated along the chunk's ``H`` actions,
    ``Cov = sigma^2 ((1 - rho) I + rho 1 1^T)`` per action dim, and scored with that density
    (``distributions.gaussian_log_prob``).  Independent noise (``rho = 0``) of a few mm per env step averages
    out within a chunk and is corrected by the next; correlated noise moves the whole chunk.

    ``freeze_obs_encoder``: the velocity net's ``obs_encoder`` (``ShortCutVelocityUNet1D``, stage 1's
    ``obs_emb_dim > 0``) takes no gradient and is left out of ``policy_parameters``; PPO moves the rest of the
    net and the noise net.  The seam where a pretrained visual encoder stays fixed while the flow is fine-tuned.
    A visual policy's noise and value nets read the encoder's embedding, not the pixels (``obs_input``).

    ``privileged_dim`` ``P`` > 0 (a visual policy, ``asymmetric_critic``): ``V`` reads the simulator's state
    ``[B, P]``, normalised (``flowlib.rl.asymmetric``), instead of the embedding; ``value(obs_window, state)``.
    """

    def __init__(self, policy, num_inference_steps: int = 8, min_noise_std: float = 0.01,
                 max_noise_std: float = 0.3, value_hidden_dims: tuple[int, ...] = (256, 256),
                 include_initial_noise: bool = False, noise_hidden: int = 128, log_prob_over: str = "chunk",
                 noise_method: str = "reinflow", noise_level: float = 0.5, hybrid: bool = False,
                 log_prob_reduce: str = "sum", critic_input: str = "obs", detach_critic_input: bool = True,
                 act_horizon: int | None = 0, obs_clip: float = 5.0, noise_corr: float = 0.0,
                 freeze_obs_encoder: bool = False, clip_chain_means: bool = False, noise_clip: float = 0.0,
                 privileged_dim: int = 0):
        super().__init__()
        check_method(noise_method)
        if critic_input not in ("obs", "velocity_features"):
            raise ValueError(f"critic_input must be one of ('obs', 'velocity_features'), got {critic_input!r}")
        if not obs_clip >= 0:
            raise ValueError(f"obs_clip must be >= 0 (0: no clipping), got {obs_clip}")
        if not 0 <= noise_corr < 1:
            raise ValueError(f"noise_corr must be in [0, 1) (0: independent noise per chunk step), got {noise_corr}")
        if not noise_clip >= 0:
            raise ValueError(f"noise_clip must be >= 0 (0: off; ReinFlow uses 3), got {noise_clip}")
        self.obs_clip, self.noise_clip = float(obs_clip), float(noise_clip)
        self.clip_chain_means = clip_chain_means
        meta = policy.meta
        flow = policy.flow
        flow.adopt_ema()  # the policy stage 1 scored
        self.meta = meta
        self.obs_normalizer, self.action_normalizer = policy.obs_normalizer, policy.action_normalizer
        self.obs_horizon, self.pred_horizon = meta["obs_horizon"], meta["pred_horizon"]
        self.act_horizon = chunk_policy.check_act_horizon(act_horizon or meta["act_horizon"], self.obs_horizon, self.pred_horizon)
        self.action_dim, self.obs_dim = meta["action_dim"], meta["obs_dim"]
        self.score = ChainScore(num_inference_steps, self.obs_horizon, self.act_horizon, self.pred_horizon,
                                self.action_dim, log_prob_over, log_prob_reduce,
                                include_initial_noise or noise_method == "flow_noise", float(noise_corr))
        visual = meta.get("obs_mode", "state") != "state"
        obs_in = meta["obs_emb_dim"] if visual else self.obs_horizon * self.obs_dim  # NoisyVelocityUNet1D.obs_input
        self.d = flow.jump(1.0 / num_inference_steps)  # rejects K beyond what the ShortCut net was trained for
        self.actor = NoisyVelocityUNet1D(flow.net, ExploreNoiseNet(obs_in, self.action_dim, min_noise_std,
                                                                   max_noise_std, hidden=noise_hidden), visual)
        self.noise_method, self.hybrid = noise_method, hybrid
        self.register_buffer("noise_level", torch.tensor(float(noise_level)))
        self.noise_level_start, self.max_noise_std_start = float(noise_level), float(max_noise_std)
        self.eligible = stochastic_steps(noise_method, num_inference_steps)
        if self.eligible < 1:
            raise ValueError(f"{noise_method} with K = {num_inference_steps} has no stochastic step: use K >= 2")
        self.critic_input, self.detach_critic_input = critic_input, detach_critic_input
        if privileged_dim and critic_input != "obs":
            raise ValueError(f"asymmetric_critic gives V the simulator's state in place of the observation: "
                             f"critic_input must be 'obs', got {critic_input!r}")
        self._init_critic_state(privileged_dim)
        value_in = privileged_dim or (obs_in if critic_input == "obs" else chunk_policy.features_dim(meta))
        self.value_net = mlp([value_in, *value_hidden_dims, 1], act=nn.Mish)
        self.explore: torch.Generator | None = None  # set: act() samples the noisy chain with it (evaluate --noisy)
        if freeze_obs_encoder:
            if getattr(flow.net, "obs_encoder", None) is None:
                raise ValueError("freeze_obs_encoder needs a velocity net with an obs_encoder; this policy reads the "
                                 "flat observation window (stage 1 ran with obs_emb_dim 0): train stage 1 with "
                                 "obs_emb_dim > 0 or set freeze_obs_encoder: false")
            flow.net.obs_encoder.requires_grad_(False)

    @property
    def K(self) -> int:  # the chain's denoising steps (the score's, so that both change together)
        return self.score.K

    @K.setter
    def K(self, value: int) -> None:
        self.score.K = value

    @property
    def noise_corr(self) -> float:
        return self.score.noise_corr

    # parameter groups
    def policy_parameters(self):  # what PPO moves: the velocity and noise nets, less a frozen obs_encoder
        return [p for p in self.actor.parameters() if p.requires_grad]

    def value_parameters(self):
        return list(self.value_net.parameters())

    def set_max_noise_std(self, value: float) -> None:
        """The noise schedule's bound: ``max_noise_std`` of the learned noise, and the SDE methods' ``noise_level``
        scaled by the same factor (``noise_level * value / max_noise_std`` of the constructor's)."""
        self.actor.noise_net.max_noise_std.fill_(value)
        self.noise_level.fill_(self.noise_level_start * value / self.max_noise_std_start)

    def _norm_obs(self, obs_window: torch.Tensor) -> torch.Tensor:  # raw [B, To, O] -> normalised
        if obs_window.shape[1:] != (self.obs_horizon, self.obs_dim):
            raise ValueError(f"obs window must be [B, {self.obs_horizon}, {self.obs_dim}], got {tuple(obs_window.shape)}")
        o = self.obs_normalizer.normalize(obs_window)
        return o.clamp(-self.obs_clip, self.obs_clip) if self.obs_clip else o

    def _velocity_features(self, o: torch.Tensor) -> torch.Tensor:  # normalised [B, To, O] -> [B, C]
        B, dt = o.shape[0], 1.0 / self.K
        grid, d = self._grid(B, o.device)
        x = torch.zeros(B, self.pred_horizon, self.action_dim, device=o.device)
        feats = []
        for k in range(self.K):
            velocity, f = self.actor.base(x, grid[k].expand(B), d, o, return_features=True)
            x = x + velocity * dt
            feats.append(f)
        return torch.stack(feats, 1).mean(1)

    def value(self, obs_window: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:  # [B, To, O] -> [B]
        """``V``: of the normalised window (or its embedding), of the velocity net's features, or with
        ``privileged_dim`` of the simulator's state ``[B, P]`` at the window's last frame (the window is not read)."""
        if self.privileged_dim:
            return self.value_net(self.critic_obs(state, self.obs_clip)).squeeze(-1)
        o = self._norm_obs(obs_window)
        if self.critic_input == "obs":
            return self.value_net(self.actor.obs_input(o)).squeeze(-1)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.detach_critic_input):
            feats = self._velocity_features(o)
        return self.value_net(feats).squeeze(-1)

    def _grid(self, B: int, device):
        grid = time_grid(self.K, device)  # the one grid, for sampling and re-scoring alike
        d = torch.full((B,), self.d, device=device)
        return grid, d

    def _noise_std(self, t, o):
        """The learned std ``[B, 1, A]`` at ``t_k`` (shared over the chunk's H steps), or None (SDE / CPS)."""
        if self.noise_method not in LEARNED_NOISE:
            return None
        return self.actor.noise_net(t, self.actor.obs_input(o))[:, None, :]

    def stochastic_mask(self, B: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Which of the ``K`` steps carry noise, ``[B, K]``: all eligible ones, or one at random (hybrid)."""
        if self.hybrid:
            return hybrid_mask(B, self.K, self.eligible, generator)
        return full_mask(B, self.K, self.eligible)

    def joint_log_prob(self, step_log_probs: torch.Tensor, stochastic: torch.Tensor, chain: torch.Tensor):
        """``[B, K]`` step log-probs -> ``[B]`` (``ChainScore.joint``: ReinFlow Eq. 5 over the stochastic steps)."""
        return self.score.joint(step_log_probs, stochastic, chain)

    @torch.no_grad()
    def sample(self, obs_window: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False,
               return_steps: bool = False, x0: torch.Tensor | None = None):
        """Run the chain from ``x_0 ~ N(0, I)`` (drawn from ``generator`` unless ``x0 [B, H, A]`` is given).
        Returns ``chain [B, K+1, H, A]`` and ``log_prob [B]``; with ``return_steps`` also the
        stochastic-step mask ``[B, K]`` and the step log-probs ``[B, K]``."""
        o = self._norm_obs(obs_window)
        B, device = o.shape[0], o.device
        if x0 is None:
            x0 = torch.randn(B, self.pred_horizon, self.action_dim, generator=generator)
        x0 = x0.to(device)
        grid, d = self._grid(B, device)
        stochastic = torch.zeros(B, self.K, dtype=torch.bool) if deterministic else self.stochastic_mask(B, generator)
        chain, step_lp = sample_chain(lambda x, t: self.actor.base(x, t, d, o), x0, self.K, self.noise_method,
                                      float(self.noise_level), stochastic, generator, log_prob_fn=self.score.step,
                                      noise_std_fn=lambda t: self._noise_std(t, o), noise_corr=self.noise_corr,
                                      mean_bounds=self.mean_bounds(), noise_clip=self.noise_clip)
        stochastic = stochastic.to(device)
        log_prob = torch.zeros(B, device=device) if deterministic else self.joint_log_prob(step_lp, stochastic, chain)
        return (chain, log_prob, stochastic, step_lp) if return_steps else (chain, log_prob)

    def ode_chunk(self, obs_window: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """The deterministic chain's end ``x_K [B, H, A]`` (normalised) from ``x0 [B, H, A]``, with gradients to the
        velocity net: the ODE ``x_{k+1} = x_k + v(x_k, t_k) / K`` on the sampling grid (``sample(...,
        deterministic=True)`` without ``no_grad``).  What the W2 regulariser compares (``flowlib.methods.reinflow``)."""
        o = self._norm_obs(obs_window)
        grid, d = self._grid(o.shape[0], o.device)
        x = x0.to(o.device)
        for k in range(self.K):
            x = x + self.actor.base(x, grid[k].expand(len(x)), d, o) / self.K
        return x

    def step_log_probs(self, obs_window: torch.Tensor, chain: torch.Tensor, stochastic: torch.Tensor | None = None):
        """Per-step log-probs of stored chains, ``[B, K]`` (0 at ODE steps), and the mean per-dim entropy
        of the stochastic steps' Gaussians, ``[B]`` (scale-free in ``K``, ``H``, ``A``).  Only the
        stochastic ``(sample, step)`` pairs are run through the net (one per sample in hybrid mode)."""
        if chain.shape[1:] != (self.K + 1, self.pred_horizon, self.action_dim):
            raise ValueError(f"chain must be [B, {self.K + 1}, {self.pred_horizon}, {self.action_dim}], got {tuple(chain.shape)}")
        B, K = chain.shape[0], self.K
        stochastic = full_mask(B, K, self.eligible) if stochastic is None else stochastic
        stochastic = stochastic.to(chain.device)
        o = self._norm_obs(obs_window)
        b, k = stochastic.nonzero(as_tuple=True)                              # the stochastic pairs
        grid, _ = self._grid(len(b), chain.device)
        x, x_next, t = chain[b, k], chain[b, k + 1], grid[k]                  # [P, H, A] x2, [P]
        velocity = self.actor.base(x, t, torch.full_like(t, self.d), o[b])
        noise_std = self._noise_std(t, o[b])
        mean, std = transition(self.noise_method, x, velocity, t, 1.0 / K, float(self.noise_level), noise_std)
        mean = clamp_mean(mean, self.mean_bounds())
        std = torch.as_tensor(std, dtype=x.dtype, device=x.device).expand_as(x)
        lp = self.score.step(x_next, mean, std, k)                                                  # [P]
        # [P] (std is shared over H); noise_corr only adds a constant, left out so noise_std reads as sigma
        ent = gaussian_entropy(std)
        step_lp = torch.zeros(B, K, device=chain.device, dtype=lp.dtype).index_put((b, k), lp)
        entropy = torch.zeros(B, device=chain.device).index_add(0, b, ent) / stochastic.sum(1).clamp(min=1)
        return step_lp, entropy

    def log_prob(self, obs_window: torch.Tensor, chain: torch.Tensor, stochastic: torch.Tensor | None = None):
        """Joint log-prob of stored chains ``[B]`` (``joint_log_prob`` of ``step_log_probs``) and the entropy ``[B]``."""
        stochastic = full_mask(len(chain), self.K, self.eligible) if stochastic is None else stochastic
        stochastic = stochastic.to(chain.device)
        step_lp, entropy = self.step_log_probs(obs_window, chain, stochastic)
        return self.joint_log_prob(step_lp, stochastic, chain), entropy

    def mean_bounds(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With ``clip_chain_means``: the env's action range ``[-1, 1]`` in normalised units, ``([A], [A])``, into
        which every stochastic step's mean is clamped (ReinFlow's ``denoised_clip_value`` 1 on its min-max scale)."""
        if not self.clip_chain_means:
            return None
        ones = torch.ones(self.action_dim, device=self.action_normalizer.shift.device)
        return self.action_normalizer.normalize(-ones), self.action_normalizer.normalize(ones)

    def actions(self, chain: torch.Tensor) -> torch.Tensor:
        """Executed actions in env units: ``x_K[To-1 : To-1+Ta]`` unnormalised, clipped to [-1, 1]."""
        return self.action_normalizer.unnormalize(self.score.executed(chain[:, -1])).clamp(-1.0, 1.0)

    def set_inference_steps(self, K: int) -> None:
        """Run the chain at ``K`` denoising steps from now on (evaluation): the fine-tuned ShortCut velocity net
        conditioned on the step size ``d = 1/K`` (ShortCut, Frans et al. 2024, Eq. 2), so a policy trained at one K
        can be scored at another, whether RL kept ShortCut's few-step property or not.  A step may not be finer
        than the flow was trained for (``K <= shortcut_max_steps``), as for a stage-1 policy."""
        max_steps = self.meta["shortcut_max_steps"]
        if not 1 <= K <= max_steps:
            raise ValueError(f"K = {K} is outside [1, shortcut_max_steps = {max_steps}], the steps the flow was trained "
                             "for (stage 1's shortcut_max_steps)")
        self.K, self.d = K, 1.0 / K
        self.eligible = stochastic_steps(self.noise_method, K)

    @torch.no_grad()
    def act(self, obs_window: torch.Tensor, num_steps: int | None = None, generator: torch.Generator | None = None,
            x0: torch.Tensor | None = None):
        """Deterministic evaluation (``num_steps`` is ignored: the agent's ``K``), ``[B, Ta, A]``; with
        ``self.explore`` set (a generator), the noisy chain that collects training data, its step noise drawn
        from that generator: the policy PPO improves, as opposed to the one deployed.

        Same signature as ``FlowPolicy.act`` so ``flowlib.policies.bc.evaluate`` runs either policy.
        """
        if self.explore is not None:
            chain, _ = self.sample(obs_window, self.explore, x0=x0)
        else:
            chain, _ = self.sample(obs_window, generator, deterministic=True, x0=x0)
        return self.actions(chain)


# what moved to flowlib.flows.nets (2026-12-07): old imports still work, with a warning
__getattr__ = moved_names(__name__, {"ExploreNoiseNet": "flowlib.flows.nets", "NoisyVelocityUNet1D": "flowlib.flows.nets"})
