"""What every steer of a frozen flow is made of: the flow's deterministic chain (``FrozenFlow``) plus a small head.

ReinFlow (``flowlib.methods.reinflow_agent``) moves the flow's weights through a noisy chain.  The steers keep the stage-1/2
flow as it is and learn a small policy around it: DSRL's policy over the chain's start ``x_0`` (``flowlib.methods.latent``,
``flowlib.methods.latent_sac``), a residual per chunk (``flowlib.methods.residual``) or per env step (``flowlib.methods.residual_step``).
Each is *composed* of

    FrozenFlow     the flow's ODE, ``x_{k+1} = x_k + v_theta(x_k, t_k | o) / K`` on ``flows.time_grid(K)``, with the
                   velocity net's EMA weights, frozen; the normalisers, horizons and the executed slice of a chunk
    GaussianHead   ``N(mu_phi(h), sigma^2)`` with ``mu_phi = b tanh(f_phi(h))`` and one learned ``sigma`` per dim in
                   ``[min_noise_std, max_noise_std]``; ``f_phi``'s last layer starts at zero
    a critic       whatever its learner needs (PPO's ``V``, SAC's or TD3's twin ``Q``), and nothing else

A chunk steer's decision is one Gaussian draw, stored as PPO's rollouts store every decision (the layout of
``flowlib.methods.gaussian``): ``decision [B, 2, H, A]``, row 0 the draw (``x_0``, or ``r`` in the executed rows), row 1
the chunk that runs; its ``[B, 1]`` stochastic mask and step log-prob.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from flowlib.flows.distributions import gaussian_entropy, gaussian_log_prob
from flowlib.flows.models import time_grid
from flowlib.flows.nets import mlp
from flowlib.policies import chunk_policy

# The noisy chain's options (``ReinFlowAgent``'s) that mean nothing for a steer, which runs the flow's ODE: each
# must stay at this default.
CHAIN_ONLY_OPTIONS = (("hybrid", False), ("include_initial_noise", False), ("noise_corr", 0.0),
                      ("noise_method", "reinflow"), ("log_prob_over", "chunk"), ("critic_input", "obs"))


def refuse_chain_options(options: dict, why: str) -> None:
    """Raise naming the first of ``CHAIN_ONLY_OPTIONS`` that ``options`` sets away from its default, and ``why``."""
    for key, default in CHAIN_ONLY_OPTIONS:
        if options.get(key, default) != default:
            raise ValueError(f"{why}: {key} must be {default!r}, got {options[key]!r}")


class FrozenFlow(nn.Module):
    """A stage-1/2 ``FlowPolicy``'s deterministic chain with ``K`` steps, its weights frozen (the EMA copy's).

    ``act_horizon`` (0: the policy's own) is how many of a chunk's actions run; ``obs_clip`` clips the normalised
    observations (0: off) before any net sees them, as ``ReinFlowAgent`` does (the reason is written there)."""

    def __init__(self, policy, num_inference_steps: int, act_horizon: int | None = 0, obs_clip: float = 5.0):
        super().__init__()
        if not obs_clip >= 0:
            raise ValueError(f"obs_clip must be >= 0 (0: no clipping), got {obs_clip}")
        meta, flow = policy.meta, policy.flow
        flow.adopt_ema()  # the policy stage 1 scored
        self.meta, self.K, self.obs_clip = meta, num_inference_steps, float(obs_clip)
        self.obs_normalizer, self.action_normalizer = policy.obs_normalizer, policy.action_normalizer
        self.obs_horizon, self.pred_horizon = meta["obs_horizon"], meta["pred_horizon"]
        self.act_horizon = chunk_policy.check_act_horizon(act_horizon or meta["act_horizon"], self.obs_horizon, self.pred_horizon)
        self.action_dim, self.obs_dim = meta["action_dim"], meta["obs_dim"]
        self.d = flow.jump(1.0 / num_inference_steps)  # rejects K beyond what the ShortCut net was trained for
        self.net = flow.net.requires_grad_(False)
        self.visual = meta.get("obs_mode", "state") != "state"

    def norm_obs(self, obs_window: torch.Tensor) -> torch.Tensor:  # raw [B, To, O] -> normalised, clipped
        if obs_window.shape[1:] != (self.obs_horizon, self.obs_dim):
            raise ValueError(f"obs window must be [B, {self.obs_horizon}, {self.obs_dim}], got {tuple(obs_window.shape)}")
        o = self.obs_normalizer.normalize(obs_window)
        return o.clamp(-self.obs_clip, self.obs_clip) if self.obs_clip else o

    @property
    def obs_features_dim(self) -> int:
        """The width of ``obs_features``: the flat window, or a visual policy's embedding."""
        return self.meta["obs_emb_dim"] if self.visual else self.obs_horizon * self.obs_dim

    @torch.no_grad()
    def observe(self, obs_window: torch.Tensor) -> torch.Tensor:
        """What a steer keeps of a raw window ``[B, To, O]`` (its replay buffer's ``obs``): the window itself, or for a
        visual policy the frozen encoder's embedding ``[B, obs_emb_dim]`` (a replay of pixel windows would not fit:
        ~100 kB a transition at 64 x 64; the encoder is frozen, so the embedding is what it would compute later)."""
        if not self.visual:
            return obs_window
        return self.net.obs_encoder(self.norm_obs(obs_window).flatten(1))

    def obs_features(self, observed: torch.Tensor) -> torch.Tensor:
        """``[B, obs_features_dim]``, what a steer's heads read, from a raw window ``[B, To, O]`` or from ``observe``'s
        output: the normalised, clipped window flattened, or a visual policy's embedding."""
        if self.visual:
            return observed if observed.dim() == 2 else self.observe(observed)
        return self.norm_obs(observed).flatten(1)

    def draw_x0(self, B: int, generator: torch.Generator | None = None) -> torch.Tensor:  # -> [B, H, A] ~ N(0, I)
        return torch.randn(B, self.pred_horizon, self.action_dim, generator=generator)

    @torch.no_grad()
    def chunk(self, o: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """The ODE's end ``x_K [B, H, A]`` (normalised) from ``x0 [B, H, A]`` given the normalised window ``o``."""
        B, dt = len(o), 1.0 / self.K
        grid, d = time_grid(self.K, o.device), torch.full((B,), self.d, device=o.device)
        x = x0.to(o.device)
        for k in range(self.K):
            x = x + self.net(x, grid[k].expand(B), d, o) * dt
        return x

    def executed(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, ...] -> [B, Ta, ...]: the actions that run
        start = self.obs_horizon - 1
        return x[:, start:start + self.act_horizon]

    def actions(self, x: torch.Tensor) -> torch.Tensor:
        """A normalised chunk ``[B, H, A]``'s executed actions in env units ``[B, Ta, A]``, clipped to [-1, 1]."""
        return self.action_normalizer.unnormalize(self.executed(x)).clamp(-1.0, 1.0)


class GaussianHead(nn.Module):
    """``h [B, n_in] -> mu, sigma [B, D]``: ``mu = bound tanh(f(h))`` with ``f`` an MLP whose last layer starts at 0
    (``mu = 0`` at first), ``sigma = lo + (hi - lo) sigmoid(logit)`` one per dim, ``~0.95 hi`` at first; ``hi`` is
    ``max_noise_std``, which the noise schedule moves (``set_max_std``)."""

    def __init__(self, n_in: int, D: int, bound: float, hidden: tuple[int, ...], min_std: float, max_std: float):
        super().__init__()
        if not bound > 0:
            raise ValueError(f"the bound on |mu| must be > 0, got {bound}")
        if not 0 < min_std <= max_std:
            raise ValueError(f"need 0 < min_noise_std <= max_noise_std, got {min_std} and {max_std}")
        self.bound = float(bound)
        self.net = mlp([n_in, *hidden, D], act=nn.Mish)
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)
        self.std_logit = nn.Parameter(torch.full((D,), 3.0))
        self.register_buffer("std_range", torch.tensor([float(min_std), float(max_std)]))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu = self.bound * torch.tanh(self.net(h))
        lo, hi = self.std_range
        return mu, (lo + (hi - lo) * torch.sigmoid(self.std_logit)).expand_as(mu)

    def set_max_std(self, value: float) -> None:
        self.std_range[1] = value


def rename_legacy_keys(state: dict, renames: tuple[tuple[str, str], ...], dropped: tuple[str, ...]) -> dict:
    """A steer's state dict as written before it was composed of ``FrozenFlow`` and a head (when it subclassed the
    chain agent): keys starting with an old prefix renamed, those of the chain agent's unused nets left out.  A
    state dict already in today's layout passes through unchanged."""
    if not any(k.startswith("actor.base.") for k in state):
        return state
    out = {}
    for key, value in state.items():
        if key.startswith(dropped):
            continue
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


# the old layout's prefixes every steer shares: the flow's net and normalisers moved into FrozenFlow, the chain's
# noise net and noise level dropped
FLOW_RENAMES = (("actor.base.", "flow.net."), ("obs_normalizer.", "flow.obs_normalizer."),
                ("action_normalizer.", "flow.action_normalizer."))
CHAIN_DROPPED = ("actor.noise_net.", "noise_level")


class FlowSteer(chunk_policy.ChunkPolicy):
    """A policy built on a ``FrozenFlow`` (``self.flow``): its shape read through, and its state dicts of before the
    steers were composed still read (``LEGACY_RENAMES`` / ``LEGACY_DROPPED`` beyond every steer's)."""

    LEGACY_RENAMES: tuple[tuple[str, str], ...] = ()
    LEGACY_DROPPED: tuple[str, ...] = ()

    def __init__(self, policy, num_inference_steps: int, act_horizon: int | None = 0, obs_clip: float = 5.0):
        super().__init__()
        self.flow = FrozenFlow(policy, num_inference_steps, act_horizon, obs_clip)
        self.explore: torch.Generator | None = None  # set: the agent explores as its rollouts do (evaluate --noisy)

    meta = property(lambda self: self.flow.meta)
    K = property(lambda self: self.flow.K)
    obs_horizon = property(lambda self: self.flow.obs_horizon)
    pred_horizon = property(lambda self: self.flow.pred_horizon)
    act_horizon = property(lambda self: self.flow.act_horizon)
    action_dim = property(lambda self: self.flow.action_dim)
    obs_dim = property(lambda self: self.flow.obs_dim)
    obs_normalizer = property(lambda self: self.flow.obs_normalizer)
    action_normalizer = property(lambda self: self.flow.action_normalizer)

    def norm_obs(self, obs_window: torch.Tensor) -> torch.Tensor:  # raw [B, To, O] -> normalised, clipped
        return self.flow.norm_obs(obs_window)

    def observe(self, obs_window: torch.Tensor) -> torch.Tensor:  # FrozenFlow.observe
        return self.flow.observe(obs_window)

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        """Also reads a state dict written before the steers were composed (``rename_legacy_keys``)."""
        state = rename_legacy_keys(state, FLOW_RENAMES + self.LEGACY_RENAMES, CHAIN_DROPPED + self.LEGACY_DROPPED)
        return super().load_state_dict(state, strict, assign)


def steer_options(options: dict, why: str) -> dict:
    """Of the chunk-scoring options a steer is built with (``flowlib.methods.reinflow.score_options``), those it reads
    (``log_prob_reduce``, ``act_horizon``, ``obs_clip``); a chain-only one set away from its default is refused
    (``refuse_chain_options``), an unknown one is a ``TypeError``."""
    refuse_chain_options(options, why)
    known = {key for key, _ in CHAIN_ONLY_OPTIONS} | {"detach_critic_input", "log_prob_reduce", "act_horizon",
                                                       "obs_clip"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unexpected options {unknown} for a steer of the frozen flow")
    return {k: options[k] for k in ("log_prob_reduce", "act_horizon", "obs_clip") if k in options}


class ChunkSteeringAgent(FlowSteer):
    """A frozen flow plus a ``GaussianHead`` (``self.head``) whose draw, once per decision, moves the chunk, and (with
    ``STATE_VALUE``) PPO's ``V(o)``: what PPO, the rollouts and evaluation call (``sample``, ``step_log_probs``,
    ``joint_log_prob``, ``log_prob``, ``value``, ``actions``, ``act``).  A subclass builds the head and says what it
    reads and how its draw becomes the chunk (``_sample``, ``_score``, ``_draw_dims``).

    ``log_prob_reduce``: ``sum`` (the draw's log-density), ``mean`` (the same: one draw) or ``mean_dim`` (divided by
    the draw's dims, as ``ReinFlowAgent`` does for the chain).  The decision layout is in the module docstring."""

    STATE_VALUE = True  # PPO's V(o); an off-policy learner's agent has its Q instead
    train_flow = False  # True: the flow's net is trained too (RFC beside PPO, ``flowlib.methods.rfc.RFCRegulariser``)

    def __init__(self, policy, num_inference_steps: int, value_hidden_dims: tuple[int, ...] = (256, 256),
                 log_prob_reduce: str = "sum", act_horizon: int | None = 0, obs_clip: float = 5.0):
        super().__init__(policy, num_inference_steps, act_horizon, obs_clip)
        reduces = ("sum", "mean", "mean_dim")
        if log_prob_reduce not in reduces:
            raise ValueError(f"log_prob_reduce must be one of {reduces}, got {log_prob_reduce!r}")
        self.log_prob_reduce = log_prob_reduce
        if self.STATE_VALUE:
            self.value_net = mlp([self.obs_horizon * self.obs_dim, *value_hidden_dims, 1], act=nn.Mish)

    # ------------------------------------------------------------------ a subclass's part
    def _draw_dims(self) -> int:  # the draw's dims (what mean_dim divides by)
        raise NotImplementedError

    def _sample(self, o: torch.Tensor, generator: torch.Generator | None, deterministic: bool,
                x0: torch.Tensor | None):
        """Normalised ``o [B, To, O]`` -> ``(decision [B, 2, H, A], draw, mu, sigma)``: the head's draw
        ``mu + sigma eps`` (``mu`` when ``deterministic``) and the chunk it makes (``sample`` says what ``x0`` is)."""
        raise NotImplementedError

    def _score(self, o: torch.Tensor, decision: torch.Tensor):
        """A stored decision -> ``(draw, mu, sigma)`` under the current weights."""
        raise NotImplementedError

    # ------------------------------------------------------------------ what the rollouts, PPO and evaluation call
    def policy_parameters(self):
        return list(self.head.parameters()) + (list(self.flow.net.parameters()) if self.train_flow else [])

    def value_parameters(self):
        return list(self.value_net.parameters())

    def set_max_noise_std(self, value: float) -> None:
        self.head.set_max_std(value)

    def value(self, obs_window: torch.Tensor) -> torch.Tensor:  # [B, To, O] -> [B]
        return self.value_net(self.flow.norm_obs(obs_window).flatten(1)).squeeze(-1)

    def joint_log_prob(self, step_log_probs: torch.Tensor, stochastic: torch.Tensor, decision: torch.Tensor):
        """``[B, 1] -> [B]``: the draw's log-density where it was drawn, per dim with ``mean_dim``."""
        lp = step_log_probs[:, 0] * stochastic[:, 0].to(step_log_probs.dtype)
        return lp / self._draw_dims() if self.log_prob_reduce == "mean_dim" else lp

    @torch.no_grad()
    def sample(self, obs_window: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False,
               return_steps: bool = False, x0: torch.Tensor | None = None):
        """One decision per window: the head's ``mu + sigma eps`` (``eps`` from ``generator``; ``mu`` when
        ``deterministic``) and the chunk it makes.  ``x0``: the latent steer's ``eps``, the residuals' flow start.
        Returns ``decision [B, 2, H, A]`` and ``log_prob [B]``; with ``return_steps`` also the ``[B, 1]`` stochastic
        mask and step log-prob."""
        o = self.flow.norm_obs(obs_window)
        B, device = len(o), o.device
        decision, draw, mu, sigma = self._sample(o, generator, deterministic, x0)
        stochastic = torch.full((B, 1), not deterministic, dtype=torch.bool, device=device)
        step_lp = (torch.zeros(B, 1, device=device) if deterministic
                   else gaussian_log_prob(draw, mu, sigma)[:, None])
        log_prob = self.joint_log_prob(step_lp, stochastic, decision)
        return (decision, log_prob, stochastic, step_lp) if return_steps else (decision, log_prob)

    def step_log_probs(self, obs_window: torch.Tensor, decision: torch.Tensor, stochastic: torch.Tensor | None = None):
        """Stored decisions' ``log N(draw; mu, sigma^2)`` under the current weights ``[B, 1]`` (0 where not drawn) and
        the head's mean per-dim entropy ``[B]``."""
        if decision.shape[1:] != (2, self.pred_horizon, self.action_dim):
            raise ValueError(f"a decision must be [B, 2, {self.pred_horizon}, {self.action_dim}], "
                             f"got {tuple(decision.shape)}")
        draw, mu, sigma = self._score(self.flow.norm_obs(obs_window), decision)
        lp = gaussian_log_prob(draw, mu, sigma)
        if stochastic is not None:
            lp = lp * stochastic[:, 0].to(lp.device, lp.dtype)
        return lp[:, None], gaussian_entropy(sigma)

    def log_prob(self, obs_window: torch.Tensor, decision: torch.Tensor, stochastic: torch.Tensor | None = None):
        """Joint log-prob of stored decisions ``[B]`` and the entropy ``[B]``."""
        stochastic = torch.ones(len(decision), 1, dtype=torch.bool) if stochastic is None else stochastic
        step_lp, entropy = self.step_log_probs(obs_window, decision, stochastic)
        return self.joint_log_prob(step_lp, stochastic.to(step_lp.device), decision), entropy

    def actions(self, decision: torch.Tensor) -> torch.Tensor:
        """The decision's executed actions in env units ``[B, Ta, A]``."""
        return self.flow.actions(decision[:, -1])

    @torch.no_grad()
    def act(self, obs_window: torch.Tensor, num_steps: int | None = None, generator: torch.Generator | None = None,
            x0: torch.Tensor | None = None):
        """The deterministic decision's actions (``num_steps`` is ignored: the flow's ``K``), or, with
        ``self.explore`` set, a draw as the rollouts make it, from that generator."""
        if self.explore is not None:
            return self.actions(self.sample(obs_window, self.explore, x0=x0)[0])
        return self.actions(self.sample(obs_window, generator, deterministic=True, x0=x0)[0])

