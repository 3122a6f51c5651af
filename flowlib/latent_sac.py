"""Off-policy actor-critic over the initial noise of a frozen flow policy: DSRL's learner (Wagenmaker et al. 2025).

``flowlib.latent`` steers the flow through ``x_0 ~ pi_phi(. | o) = N(mu_phi(o), sigma^2 I)`` and learns
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
plus the Q nets and ``log_alpha``: stage 3's checkpoints, ``flowlib.evaluate`` and notebook 03 serve it
unchanged (``learner: sac``); its ``last.pt`` also holds the replay buffer, so a run resumes with the data it had.
"""
from __future__ import annotations

import copy
import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

from .flow_sde import gaussian_entropy
from .latent import LatentSteeringAgent
from .nets import frozen
from .reinflow import ReinFlowConfig, end_iteration, episode_stats, noise_schedule, prepare_run, resume
from .smdp import ChunkRunner


def _q_net(sizes: list[int]) -> nn.Sequential:
    """Linear -> LayerNorm -> ReLU blocks, then a linear head: LayerNorm keeps Q stable at a high update-to-data
    ratio (Ball et al. 2023, RLPD); ReLU because Mish costs a third of an update on a CPU."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 2):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.LayerNorm(sizes[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(sizes[-2], sizes[-1]))


class TwinQ(nn.Module):
    """``Q_1, Q_2 (o, w)``: ``[B, To*O]`` normalised observation window, ``[B, D]`` latent -> ``[2, B]``."""

    def __init__(self, obs_in: int, latent_dim: int, hidden: tuple[int, ...] = (256, 256)):
        super().__init__()
        self.nets = nn.ModuleList(_q_net([obs_in + latent_dim, *hidden, 1]) for _ in range(2))

    def forward(self, o_flat: torch.Tensor, w_flat: torch.Tensor) -> torch.Tensor:
        x = torch.cat([o_flat, w_flat], 1)
        return torch.stack([net(x).squeeze(-1) for net in self.nets])

    def q1(self, o_flat: torch.Tensor, w_flat: torch.Tensor) -> torch.Tensor:
        """``Q_1 (o, w)`` alone ``[B]``: what TD3's deterministic policy gradient follows (Fujimoto et al. 2018,
        Alg. 1), without ``Q_2``'s forward and backward."""
        return self.nets[0](torch.cat([o_flat, w_flat], 1)).squeeze(-1)


class LatentSACAgent(LatentSteeringAgent):
    """``LatentSteeringAgent`` (the policy over ``x_0``, the frozen flow, its sampling and evaluation) with the
    twin ``Q(o, x_0)``, its Polyak target and the temperature ``alpha = exp(log_alpha)`` (module docstring).
    Its ``value_net`` (PPO's V) is not trained."""

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


class ReplayBuffer:
    """A ring of the last ``capacity`` chunk decisions: ``obs [To, O]``, latent ``w [H, A]``, the SMDP reward
    ``R``, the bootstrap factor ``gamma^tau (1 - terminal)`` and ``next_obs [To, O]`` (for an episode that ended,
    its last window, which a termination does not bootstrap from and a truncation does); ``extra`` names more
    fields and their shapes (``flowlib.residual_step`` stores the base actions)."""

    def __init__(self, capacity: int, obs_shape: tuple[int, ...], latent_shape: tuple[int, ...],
                 **extra: tuple[int, ...]):
        shapes = {"obs": obs_shape, "latent": latent_shape, "reward": (), "bootstrap": (), "next_obs": obs_shape,
                  **extra}
        self.fields = tuple(shapes)
        self.data = {k: torch.zeros(capacity, *shapes[k]) for k in self.fields}
        self.capacity, self.ptr, self.size = capacity, 0, 0

    def __len__(self) -> int:
        return self.size

    def add(self, **rows: torch.Tensor) -> None:
        """Append ``[N, ...]`` rows of every field."""
        if set(rows) != set(self.fields):
            raise ValueError(f"add needs exactly the fields {self.fields}, got {sorted(rows)}")
        n = len(rows["obs"])
        idx = (self.ptr + torch.arange(n)) % self.capacity
        for k in self.fields:
            self.data[k][idx] = rows[k].detach().to(self.data[k].dtype).cpu()
        self.ptr, self.size = (self.ptr + n) % self.capacity, min(self.size + n, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        if self.size == 0:
            raise ValueError("the replay buffer is empty: collect decisions before sampling")
        idx = torch.randint(self.size, (batch_size,), generator=generator)
        return {k: v[idx] for k, v in self.data.items()}

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "ptr": self.ptr, "size": self.size,
                **{k: v[:self.size].clone() for k, v in self.data.items()}}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in self.fields if k not in state]
        if missing:
            raise ValueError(f"the saved replay buffer lacks the fields {missing}: it was written by another learner")
        if state["capacity"] != self.capacity or state["obs"].shape[1:] != self.data["obs"].shape[1:]:
            raise ValueError(f"the saved replay buffer (capacity {state['capacity']}, obs {tuple(state['obs'].shape[1:])})"
                             f" does not fit this one (capacity {self.capacity}, obs {tuple(self.data['obs'].shape[1:])})")
        self.ptr, self.size = state["ptr"], state["size"]
        for k in self.fields:
            self.data[k][:self.size] = state[k]


def sac_update(agent: LatentSACAgent, batch: dict[str, torch.Tensor], actor_opt, critic_opt, cfg: ReinFlowConfig,
               train_policy: bool = True) -> dict[str, float]:
    """One gradient step of the twin critics on the SMDP target, then (``train_policy``) of the actor and
    the temperature, then the Polyak step of the targets (module docstring).  ``actor_opt`` holds the policy's
    parameters and, when alpha learns, ``log_alpha`` in a group of its own."""
    device = agent.log_alpha.device
    b = {k: v.to(device) for k, v in batch.items()}
    o, o_next = agent._norm_obs(b["obs"]), agent._norm_obs(b["next_obs"])
    alpha = agent.log_alpha.exp().detach()
    with torch.no_grad():
        w_next, *_ = agent.rsample(o_next, torch.randn_like(b["latent"]))
        q_next = agent.q_target(o_next.flatten(1), w_next).min(0).values
        y = b["reward"] + b["bootstrap"] * q_next                                      # [B]
    q = agent.q(o.flatten(1), b["latent"].flatten(1))                                     # [2, B]
    q_loss = (q - y).pow(2).mean(1).sum()
    critic_opt.zero_grad(set_to_none=True)
    q_loss.backward()
    nn.utils.clip_grad_norm_(agent.value_parameters(), cfg.max_grad_norm)
    critic_opt.step()
    stats = {"value_loss": q_loss.item() / 2, "q": q.mean().item(), "target": y.mean().item()}
    if train_policy:
        w, mu, sigma = agent.rsample(o, torch.randn_like(b["latent"]))                  # [B, D], [B, H, A] x2
        with frozen(agent.q):  # dQ/dw only: the critics' weight gradients would be dropped
            q_pi = agent.q(o.flatten(1), w).min(0).values
        kl = prior_kl(mu, sigma)                                                          # [B]
        actor_loss = (alpha * kl - q_pi).mean()
        alpha_loss = -(agent.log_alpha.exp() * (kl.detach() - cfg.sac_target_kl)).mean()
        actor_opt.zero_grad(set_to_none=True)
        (actor_loss + alpha_loss).backward()  # disjoint parameters: kl is detached in alpha_loss, alpha in actor_loss
        nn.utils.clip_grad_norm_(agent.policy_parameters(), cfg.max_grad_norm)
        actor_opt.step()
        stats.update({"policy_loss": actor_loss.item(), "kl": kl.mean().item(),
                      "entropy": gaussian_entropy(sigma).mean().item(),
                      "mu_rms": mu.pow(2).mean().sqrt().item()})
    agent.update_target(cfg.sac_tau)
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


def optimizers(agent: LatentSACAgent, cfg: ReinFlowConfig):
    """``(actor_opt, critic_opt)``: Adam over the policy (and ``log_alpha``, at ``sac_alpha_lr``, unless 0) and
    over the twin Q, with torch's fused kernel (``residual_step.optimizers``)."""
    groups = [{"params": agent.policy_parameters(), "lr": cfg.actor_lr}]
    if cfg.sac_alpha_lr > 0:
        groups.append({"params": [agent.log_alpha], "lr": cfg.sac_alpha_lr})
    else:
        agent.log_alpha.requires_grad_(False)
    return (torch.optim.Adam(groups, fused=True),
            torch.optim.Adam(agent.value_parameters(), lr=cfg.critic_lr, fused=True))


def resume_with_replay(cfg: ReinFlowConfig, agent, last, actor_opt, critic_opt, env, buffer: ReplayBuffer,
                       tracker=None):
    """``reinflow.resume`` for an off-policy learner: ``(iteration, runner, best)``, and ``buffer`` refilled from
    ``last`` when the run goes on from it."""
    start, runner, best, ckpt = resume(cfg, agent, last, actor_opt, critic_opt, env, tracker)
    if ckpt is not None:
        if "replay" not in ckpt:
            raise ValueError(f"{last} holds no replay buffer, so it is not a learner {cfg.learner!r} run: use another "
                             "run_name or resume=False")
        buffer.load_state_dict(ckpt["replay"])
    return start, runner, best


def on_all_cores(step, n: int) -> list:
    """``[step(i) for i in range(n)]`` with every core given to torch: the env workers wait while the nets learn."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return [step(i) for i in range(n)]
    finally:
        torch.set_num_threads(threads)


def train(cfg: ReinFlowConfig, agent: LatentSACAgent, env, run_path, tracker=None) -> dict:
    """DSRL-SAC: each iteration collects ``rollout_steps`` decisions per env into the replay buffer, then takes
    ``sac_updates_per_decision`` gradient steps per new decision on batches of ``sac_batch_size`` (the critics only
    in iterations that start before ``critic_warmup_steps``, and none until the buffer holds one batch).
    Evaluation, ``best_model.pt``, ``last.pt`` (with the buffer) and resuming are as in ``reinflow.train``."""
    if not isinstance(agent, LatentSACAgent):
        raise TypeError(f"learner 'sac' trains a LatentSACAgent (steer: latent, learner: sac), got {type(agent).__name__}")
    run_path = prepare_run(cfg, agent, run_path)
    actor_opt, critic_opt = optimizers(agent, cfg)
    N = env.num_envs
    per_iter = cfg.rollout_steps * N * agent.act_horizon
    num_iters = max(1, math.ceil(cfg.total_env_steps / per_iter))
    last = run_path / "last.pt"
    buffer = ReplayBuffer(cfg.sac_buffer_size, (agent.obs_horizon, agent.obs_dim), (agent.pred_horizon, agent.action_dim))
    start, runner, best = resume_with_replay(cfg, agent, last, actor_opt, critic_opt, env, buffer, tracker)
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + start)
    updates = max(1, round(cfg.sac_updates_per_decision * cfg.rollout_steps * N))
    bar = tqdm(total=num_iters, initial=start, desc="DSRL-SAC", mininterval=10)
    for iteration in range(start, num_iters):
        agent.set_max_noise_std(noise_schedule(cfg.noise_schedule, runner.env_steps / max(cfg.noise_decay_steps, 1),
                                               cfg.max_noise_std, cfg.final_noise_std))
        agent.eval()
        steps_before, t0 = runner.env_steps, time.time()
        policy_time = collect(agent, runner, buffer, cfg.rollout_steps, gen)
        rollout_time = time.time() - t0
        warmup = steps_before < cfg.critic_warmup_steps
        agent.train()
        t1 = time.time()
        stats = on_all_cores(lambda _: sac_update(agent, buffer.sample(cfg.sac_batch_size, gen), actor_opt, critic_opt,
                                                  cfg, not warmup),
                             updates if len(buffer) >= cfg.sac_batch_size else 0)
        update_time = time.time() - t1
        with torch.no_grad():  # sigma is one learned std per dim of x_0
            _, sigma = agent._latent(agent._norm_obs(runner.window[:1].to(agent.log_alpha.device)))
        row = {"iteration": iteration + 1, "critic_warmup": float(warmup), "rollout_time": rollout_time,
               "rollout_policy_time": policy_time, "update_time": update_time,
               "env_steps_per_s": per_iter / max(rollout_time, 1e-9), "updates": len(stats), "buffer": len(buffer),
               "alpha": agent.log_alpha.exp().item(), "noise_std": sigma.log().mean().exp().item(),
               **{k: float(np.mean([s[k] for s in stats])) for k in (stats[-1] if stats else {})}}
        episodes = runner.pop_finished()
        row.update({"episodes": len(episodes), **episode_stats(episodes)})
        best = end_iteration(cfg, agent, env, runner, row, best, iteration, num_iters, run_path, actor_opt, critic_opt,
                             tracker, extra=lambda: {"replay": buffer.state_dict()})
        bar.update()
    bar.close()
    agent.eval()
    return {"best": best, "iterations": num_iters, "env_steps": runner.env_steps}
