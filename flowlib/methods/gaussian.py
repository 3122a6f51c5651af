"""The plain baseline: a Gaussian MLP policy over the action chunk, cloned from the same demos, fine-tuned by PPO.

What does the flow buy?  DPPO (Ren et al. 2024, Sec. 5) and the RLinf notes answer it by running PPO on a Gaussian
policy beside the diffusion / flow one, from the same demonstrations and with the same budget.  Here

    a ~ pi_phi(. | o) = N(mu_phi(o), diag sigma^2),      mu_phi: MLP(obs window [To * O]) -> chunk [H, A]

in the flow's normalised action space (the stage-1 checkpoint's normalisers), optionally soft-clipped,
``mu = b tanh(mu_phi / b)`` with ``b = gaussian_mean_bound`` (identity for ``|mu_phi| << b``; without it PPO can push
the mean far outside the action box, where the executed actions' clamp leaves the reward flat and float32 rounding of
``a - mu`` alone moves a log-prob: peg-insert-side, docs/results/metaworld.md), ``sigma`` one learned std per chunk
dim, squashed into ``[min_noise_std, max_noise_std]`` (the stage-3 noise schedule moves the upper bound, as for the
other steers).  Before RL, ``gaussian_bc`` fits ``mu_phi`` to the start checkpoint's own demonstrations by mean
squared error (the Gaussian's maximum likelihood at a fixed ``sigma``); nothing of the flow is used but its data,
normalisers and chunk shape.  A decision's log-prob is ``log N(a; mu, sigma^2)`` over the executed actions' dims
(the chunk's other dims reach nothing), one MLP call to re-score.  Deterministic evaluation executes ``mu``.

``GaussianChunkAgent`` has the interface PPO's rollouts and update use (``flowlib.methods.reinflow.collect``,
``flowlib.rl.ppo.ppo_update``): a decision is stored as a chain of one step, ``[B, 2, H, A]`` with ``x_1 = a`` (``x_0``
is zeros: there is no latent), and the ``[B, 1]`` stochastic mask is true.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from flowlib.envs.data import ChunkDataset
from flowlib.envs.maniskill import is_fast
from flowlib.flows.distributions import gaussian_entropy, gaussian_log_prob
from flowlib.flows.nets import mlp
from flowlib.infra import progress
from flowlib.infra.config import NonNegativeFloat, NonNegativeInt, PositiveInt
from flowlib.methods.reinflow_agent import LOG_PROB_REDUCE
from flowlib.policies import bc, chunk_policy


@dataclass
class GaussianConfig:
    """The Gaussian baseline (steer ``"gaussian"``, learner PPO); its std is bounded by ``min/max_noise_std``."""

    gaussian_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [256, 256, 256])  # mu's MLP
    gaussian_bc_steps: NonNegativeInt = 5000  # Adam steps of BC on the start's demos before RL (0: none)
    gaussian_bc_batch: PositiveInt = 512  # demo windows per BC step
    gaussian_mean_bound: NonNegativeFloat = 0.0  # bound b of the mean, b tanh(mu_phi / b), in normalised units; 0: none


class GaussianChunkAgent(chunk_policy.ChunkPolicy):
    """``N(mu_phi(o), sigma^2)`` over the normalised chunk, with a value net (module docstring).  ``policy`` is the
    stage-1/2 flow policy whose normalisers, horizons and dims it takes (not its weights)."""

    K = 1  # one stochastic "step" per decision: the draw of the chunk

    def __init__(self, policy, min_noise_std: float = 0.05, max_noise_std: float = 0.3,
                 value_hidden_dims: tuple[int, ...] = (256, 256), hidden_dims: tuple[int, ...] = (256, 256, 256),
                 log_prob_reduce: str = "sum", act_horizon: int | None = 0, obs_clip: float = 5.0,
                 mean_bound: float = 0.0):
        super().__init__()
        if log_prob_reduce not in LOG_PROB_REDUCE:
            raise ValueError(f"log_prob_reduce must be one of {LOG_PROB_REDUCE}, got {log_prob_reduce!r}")
        if not 0 < min_noise_std <= max_noise_std:
            raise ValueError(f"need 0 < min_noise_std <= max_noise_std, got {min_noise_std} and {max_noise_std}")
        meta = policy.meta
        self.meta, self.obs_normalizer, self.action_normalizer = meta, policy.obs_normalizer, policy.action_normalizer
        self.obs_horizon, self.pred_horizon = meta["obs_horizon"], meta["pred_horizon"]
        self.act_horizon = chunk_policy.check_act_horizon(act_horizon or meta["act_horizon"], self.obs_horizon, self.pred_horizon)
        self.action_dim, self.obs_dim = meta["action_dim"], meta["obs_dim"]
        self.log_prob_reduce, self.obs_clip = log_prob_reduce, float(obs_clip)
        if mean_bound < 0:
            raise ValueError(f"gaussian_mean_bound must be >= 0 (0: unbounded), got {mean_bound}")
        self.mean_bound = float(mean_bound)
        obs_in, D = self.obs_horizon * self.obs_dim, self.pred_horizon * self.action_dim
        self.mean_net = mlp([obs_in, *hidden_dims, D], act=nn.Mish)
        self.std_logit = nn.Parameter(torch.full((D,), 3.0))  # sigma ~ 0.95 max_noise_std at the start
        self.register_buffer("std_range", torch.tensor([float(min_noise_std), float(max_noise_std)]))
        self.value_net = mlp([obs_in, *value_hidden_dims, 1], act=nn.Mish)
        self.explore: torch.Generator | None = None  # set: act() draws from the Gaussian (evaluate --noisy)

    # ------------------------------------------------------------------ the Gaussian
    def _norm_obs(self, obs_window: torch.Tensor) -> torch.Tensor:  # raw [B, To, O] -> normalised, clipped
        if obs_window.shape[1:] != (self.obs_horizon, self.obs_dim):
            raise ValueError(f"obs window must be [B, {self.obs_horizon}, {self.obs_dim}], "
                             f"got {tuple(obs_window.shape)}")
        o = self.obs_normalizer.normalize(obs_window.to(self.std_range.device))
        return o.clamp(-self.obs_clip, self.obs_clip) if self.obs_clip else o

    def mean(self, o: torch.Tensor) -> torch.Tensor:  # normalised [B, To, O] -> mu [B, H, A]
        return soft_clip(self.mean_net(o.flatten(1)), self.mean_bound).view(len(o), self.pred_horizon, self.action_dim)

    def std(self) -> torch.Tensor:  # [H, A]
        lo, hi = self.std_range
        return (lo + (hi - lo) * torch.sigmoid(self.std_logit)).view(self.pred_horizon, self.action_dim)

    def _executed(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, A] -> [B, Ta, A]
        start = self.obs_horizon - 1
        return x[:, start:start + self.act_horizon]

    def _score(self, a: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``log N(a; mu, sigma^2)`` over the executed dims ``[B]`` and the mean per-dim entropy ``[B]``."""
        sigma = self._executed(self.std().expand_as(mu))
        return gaussian_log_prob(self._executed(a), self._executed(mu), sigma), gaussian_entropy(sigma)

    # ------------------------------------------------------------------ what PPO and the rollouts call
    def policy_parameters(self):
        return [*self.mean_net.parameters(), self.std_logit]

    def value_parameters(self):
        return list(self.value_net.parameters())

    def set_max_noise_std(self, value: float) -> None:
        self.std_range[1] = value

    def value(self, obs_window: torch.Tensor) -> torch.Tensor:  # [B, To, O] -> [B]
        return self.value_net(self._norm_obs(obs_window).flatten(1)).squeeze(-1)

    def joint_log_prob(self, step_log_probs: torch.Tensor, stochastic: torch.Tensor, chain: torch.Tensor):
        """``[B, 1] -> [B]``: the draw's log-density, summed (``sum``) or per executed dim (``mean_dim``; ``mean``
        over one step is the sum)."""
        lp = step_log_probs[:, 0] * stochastic[:, 0].to(step_log_probs.dtype)
        return lp / (self.act_horizon * self.action_dim) if self.log_prob_reduce == "mean_dim" else lp

    @torch.no_grad()
    def sample(self, obs_window: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False,
               return_steps: bool = False, x0: torch.Tensor | None = None):
        """``a = mu(o) + sigma eps`` (``eps`` from ``generator``, or ``x0 [B, H, A]`` when given; ``a = mu(o)`` when
        ``deterministic``).  Returns ``chain [B, 2, H, A]`` (``[:, 1] = a``) and ``log_prob [B]``; with
        ``return_steps`` also the stochastic mask and the step log-probs, each ``[B, 1]``."""
        mu = self.mean(self._norm_obs(obs_window))
        B, device = len(mu), mu.device
        stochastic = torch.full((B, 1), not deterministic, dtype=torch.bool, device=device)
        if deterministic:
            a, step_lp = mu, torch.zeros(B, 1, device=device)
        else:
            eps = torch.randn(mu.shape, generator=generator) if x0 is None else x0
            a = mu + self.std() * eps.to(device)
            step_lp = self._score(a, mu)[0][:, None]
        chain = torch.stack([torch.zeros_like(a), a], 1)
        log_prob = self.joint_log_prob(step_lp, stochastic, chain)
        return (chain, log_prob, stochastic, step_lp) if return_steps else (chain, log_prob)

    def step_log_probs(self, obs_window: torch.Tensor, chain: torch.Tensor, stochastic: torch.Tensor | None = None):
        """The stored draws' log-densities under the current weights ``[B, 1]`` and the entropy ``[B]``."""
        if chain.shape[1:] != (2, self.pred_horizon, self.action_dim):
            raise ValueError(f"chain must be [B, 2, {self.pred_horizon}, {self.action_dim}], got {tuple(chain.shape)}")
        lp, entropy = self._score(chain[:, 1], self.mean(self._norm_obs(obs_window)))
        if stochastic is not None:
            lp = lp * stochastic[:, 0].to(lp.device, lp.dtype)
        return lp[:, None], entropy

    def log_prob(self, obs_window: torch.Tensor, chain: torch.Tensor, stochastic: torch.Tensor | None = None):
        stochastic = torch.ones(len(chain), 1, dtype=torch.bool) if stochastic is None else stochastic
        step_lp, entropy = self.step_log_probs(obs_window, chain, stochastic)
        return self.joint_log_prob(step_lp, stochastic.to(step_lp.device), chain), entropy

    def actions(self, chain: torch.Tensor) -> torch.Tensor:
        """Executed actions in env units, ``[B, Ta, A]``: the draw's executed slice unnormalised, clipped to [-1, 1]."""
        return self.action_normalizer.unnormalize(self._executed(chain[:, -1])).clamp(-1.0, 1.0)

    @torch.no_grad()
    def act(self, obs_window: torch.Tensor, num_steps: int | None = None, generator: torch.Generator | None = None,
            x0: torch.Tensor | None = None):
        """The mean's executed actions (``num_steps`` is ignored), or a draw when ``self.explore`` is set."""
        if self.explore is not None:
            return self.actions(self.sample(obs_window, self.explore)[0])
        return self.actions(self.sample(obs_window, deterministic=True)[0])


def soft_clip(x: torch.Tensor, bound: float) -> torch.Tensor:
    """``b tanh(x / b)``: ``x`` where ``|x| << b``, never beyond ``b``; ``x`` itself when ``bound`` is 0."""
    return bound * torch.tanh(x / bound) if bound else x


def gaussian_agent(policy, cfg) -> GaussianChunkAgent:
    """The Gaussian baseline's agent of ``cfg``, untrained (``gaussian_bc`` clones it before RL)."""
    return GaussianChunkAgent(policy, cfg.min_noise_std, cfg.max_noise_std, tuple(cfg.value_hidden_dims),
                              tuple(cfg.gaussian_hidden_dims), cfg.log_prob_reduce, cfg.act_horizon, cfg.obs_clip,
                              cfg.gaussian_mean_bound)


def gaussian_bc(agent: GaussianChunkAgent, cfg, start: Path) -> None:
    """Behaviour cloning of ``agent``'s mean on the demonstrations the stage-1 checkpoint ``start`` was trained on
    (its config's ``env_id``, ``num_demos`` and ``demo_file``): ``cfg.gaussian_bc_steps`` Adam steps (lr 1e-3,
    batches of ``cfg.gaussian_bc_batch``) of ``|mu(o) - a|^2`` (the mean as the agent computes it, bounded or not)
    over chunks normalised as the start's, from weights seeded by ``cfg.seed``.  Kept per process, so a notebook that
    builds the start twice clones once."""
    if cfg.gaussian_bc_steps == 0:
        return
    state = _cloned_state(str(start), Path(start).stat().st_mtime, cfg.gaussian_bc_steps, cfg.gaussian_bc_batch,
                          tuple(cfg.gaussian_hidden_dims), cfg.seed, agent.obs_clip, agent.mean_bound)
    agent.mean_net.load_state_dict(state)


@functools.lru_cache(maxsize=4)
def _cloned_state(start: str, mtime: float, steps: int, batch: int, hidden: tuple, seed: int, obs_clip: float,
                  mean_bound: float) -> dict:
    episodes = bc.training_demos(start)
    policy = chunk_policy.load_policy(start)
    dataset = ChunkDataset(episodes, policy.obs_horizon, policy.pred_horizon,
                           gripper=not is_fast(policy.meta["env_id"]))
    obs, actions = dataset.tensors(policy.obs_normalizer, policy.action_normalizer)  # [N, To, O], [N, H, A]
    obs = (obs.clamp(-obs_clip, obs_clip) if obs_clip else obs).flatten(1)
    torch.manual_seed(seed)
    net = mlp([obs.shape[1], *hidden, actions[0].numel()], act=nn.Mish)
    opt, gen = torch.optim.Adam(net.parameters(), lr=1e-3), torch.Generator().manual_seed(seed)
    for _ in progress.bar(steps, "Gaussian BC", unit="step", iterable=range(steps)):
        idx = torch.randint(len(obs), (batch,), generator=gen)
        loss = (soft_clip(net(obs[idx]), mean_bound) - actions[idx].flatten(1)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    print(f"Gaussian BC: {steps} steps on {len(episodes)} demos ({len(obs)} windows), last batch's MSE "
          f"{loss.item():.4f} (normalised units)")
    return {k: v.detach().clone() for k, v in net.state_dict().items()}
