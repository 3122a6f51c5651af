"""FQL, flow Q-learning (Park, Li & Levine 2025): a one-step policy distilled from the flow and trained against Q,
offline on the demonstrations, then online with the replay seeded from them.

The flow ``mu_theta(s, z)`` (the stage-1 policy's deterministic chain from ``z = x_0``, ``K`` ODE steps, kept frozen:
it was fitted to the same demos by stage 1, where FQL fits it alongside) is distilled into a one-step policy
``mu_omega(s, z)``, an MLP from the observation window and the noise to the whole chunk, which alone acts and alone
is pushed by the critic (FQL Eq. 6-7)::

    L_pi(omega) = E_{s, z ~ N(0, I)} [ -Q(s, mu_omega(s, z)) / |Q|  +  alpha |mu_omega(s, z) - mu_theta(s, z)|^2 ]

(``|Q|`` the batch's mean ``|Q|``, no gradient: FQL's normalised Q loss; the squared distance averaged over the
chunk's dims).  The critics are twin ``Q_j(s, a)`` of the executed actions ``a [Ta, A]`` (normalised), fitted on
chunk decisions as a semi-MDP (``flowlib.envs.smdp``) with FQL's mean over the twins at the target::

    y = R + gamma^tau (1 - terminal) mean_j Q_bar_j(s', mu_omega(s', z')),      z' ~ N(0, I)

Offline (``fql_offline_steps``, before any env step, in ``flowlib.methods.stage3.build_agent``): these updates on the
demonstrations turned into chunk decisions with the sparse reward (1 at the first success, which ends the
episode).  Online: the ``ReplayLearner`` loop, its replay holding the same demo decisions first, then the
policy's own (``z ~ N(0, I)`` is the exploration); evaluation draws ``z`` from each episode's generator as stage 1
draws ``x_0``, so the one-step policy is scored as the flow is.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from flowlib.envs.data import ChunkDataset
from flowlib.envs.maniskill import is_fast
from flowlib.envs.smdp import ChunkRunner
from flowlib.flows.nets import TwinQ, frozen, mlp
from flowlib.infra import progress
from flowlib.infra.config import NonNegativeInt, PositiveFloat, PositiveInt
from flowlib.infra.guards import require_finite
from flowlib.infra.runs import policy_checkpoint
from flowlib.policies import bc, chunk_policy
from flowlib.rl.buffers import ReplayBuffer
from flowlib.rl.learners import ReplayLearner, twin_q_step


@dataclass
class FQLConfig:
    """FQL's options (steer ``"one_step"``, learner ``"fql"``; ``ReplayConfig`` sizes its replay and batches)."""

    fql_alpha: PositiveFloat = 10.0  # weight of the distillation |mu_omega - mu_theta|^2 against the normalised -Q
    fql_offline_steps: NonNegativeInt = 10_000  # gradient steps on the demos before any env step
    fql_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [256, 256, 256])  # mu_omega's MLP


class FQLAgent(chunk_policy.ChunkPolicy):
    """The frozen flow (``policy``, a stage-1 ``FlowPolicy``), the one-step policy ``mu_omega``, the twin ``Q`` and
    its Polyak target (module docstring)."""

    def __init__(self, policy, num_inference_steps: int = 4, hidden_dims: tuple[int, ...] = (256, 256, 256),
                 value_hidden_dims: tuple[int, ...] = (256, 256), act_horizon: int | None = 0, obs_clip: float = 5.0):
        super().__init__()
        meta = policy.meta
        self.flow_policy = policy.eval().requires_grad_(False)
        self.meta, self.obs_normalizer, self.action_normalizer = meta, policy.obs_normalizer, policy.action_normalizer
        self.obs_horizon, self.pred_horizon = meta["obs_horizon"], meta["pred_horizon"]
        self.act_horizon = chunk_policy.check_act_horizon(act_horizon or meta["act_horizon"], self.obs_horizon, self.pred_horizon)
        self.action_dim, self.obs_dim = meta["action_dim"], meta["obs_dim"]
        self.K, self.obs_clip = num_inference_steps, float(obs_clip)
        policy.flow.jump(1.0 / num_inference_steps)  # rejects K beyond what the ShortCut net was trained for
        obs_in, D = self.obs_horizon * self.obs_dim, self.pred_horizon * self.action_dim
        self.one_step = mlp([obs_in + D, *hidden_dims, D], act=nn.Mish)
        self.q = TwinQ(obs_in, self.act_horizon * self.action_dim, tuple(value_hidden_dims))
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)
        self.register_buffer("offline_done", torch.tensor(False))  # the offline phase ran (saved in checkpoints)
        self.explore: torch.Generator | None = None  # evaluate --noisy: z from this generator (it is z already)

    def norm_obs(self, obs_window: torch.Tensor) -> torch.Tensor:  # raw [B, To, O] -> normalised, clipped
        if obs_window.shape[1:] != (self.obs_horizon, self.obs_dim):
            raise ValueError(f"obs window must be [B, {self.obs_horizon}, {self.obs_dim}], "
                             f"got {tuple(obs_window.shape)}")
        o = self.obs_normalizer.normalize(obs_window.to(self.offline_done.device))
        return o.clamp(-self.obs_clip, self.obs_clip) if self.obs_clip else o

    def chunk(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``mu_omega(s, z)``: normalised ``o [B, To, O]``, ``z [B, H, A]`` -> the normalised chunk ``[B, H, A]``."""
        return self.one_step(torch.cat([o.flatten(1), z.flatten(1)], 1)).view_as(z)

    @torch.no_grad()
    def flow_chunk(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``mu_theta(s, z)``: the frozen flow's ODE chunk from ``z`` (normalised), the distillation target."""
        return self.flow_policy.flow.integrate(z, self.K, obs=o)

    def executed(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, A] -> [B, Ta * A]: what Q scores
        start = self.obs_horizon - 1
        return x[:, start:start + self.act_horizon].flatten(1)

    def policy_parameters(self):
        return list(self.one_step.parameters())

    def value_parameters(self):
        return list(self.q.parameters())

    def set_max_noise_std(self, value: float) -> None:
        """No schedule: FQL explores through ``z ~ N(0, I)`` alone."""

    @torch.no_grad()
    def update_target(self, tau: float) -> None:
        for p, p_bar in zip(self.q.parameters(), self.q_target.parameters()):
            p_bar.lerp_(p, tau)

    @torch.no_grad()
    def act(self, obs_window: torch.Tensor, num_steps: int | None = None, generator: torch.Generator | None = None,
            x0: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, Ta, A]`` in env units: ``mu_omega(s, z)``'s executed actions, ``z = x0`` when given (evaluation's
        per-episode draws) or drawn from ``self.explore`` / ``generator`` (``num_steps`` is ignored)."""
        o = self.norm_obs(obs_window)
        if x0 is None:
            x0 = torch.randn(len(o), self.pred_horizon, self.action_dim, generator=self.explore or generator)
        x = self.chunk(o, x0.to(o.device))
        start = self.obs_horizon - 1
        return self.action_normalizer.unnormalize(x[:, start:start + self.act_horizon]).clamp(-1.0, 1.0)


def fql_update(agent: FQLAgent, batch: dict[str, torch.Tensor], actor_opt, critic_opt, cfg,
               train_policy: bool = True) -> dict[str, float]:
    """One step of the critics on the target, then (``train_policy``) of ``mu_omega`` on FQL's loss, then the Polyak
    step (module docstring).  ``batch``: ``obs``, ``latent`` (the executed actions ``[B, Ta, A]``, normalised),
    ``reward``, ``bootstrap``, ``next_obs``."""
    device = agent.offline_done.device
    b = {k: v.to(device) for k, v in batch.items()}
    o, o_next = agent.norm_obs(b["obs"]), agent.norm_obs(b["next_obs"])
    shape = (len(o), agent.pred_horizon, agent.action_dim)
    with torch.no_grad():
        a_next = agent.executed(agent.chunk(o_next, torch.randn(shape, device=device)))
        y = b["reward"] + b["bootstrap"] * agent.q_target(o_next.flatten(1), a_next).mean(0)     # [B]
    q = agent.q(o.flatten(1), b["latent"].flatten(1))                                          # [2, B]
    stats = twin_q_step(q, y, critic_opt, agent.value_parameters(), cfg.max_grad_norm, "an FQL step")
    if train_policy:
        z = torch.randn(shape, device=device)
        x = agent.chunk(o, z)                                                                   # [B, H, A]
        distill = (x - agent.flow_chunk(o, z)).pow(2).mean()
        with frozen(agent.q):  # dQ/da only
            q_pi = agent.q(o.flatten(1), agent.executed(x)).mean(0)                            # [B]
        loss = -q_pi.mean() / q_pi.abs().mean().detach().clamp(min=1e-6) + cfg.fql_alpha * distill
        actor_opt.zero_grad(set_to_none=True)
        loss.backward()
        require_finite(nn.utils.clip_grad_norm_(agent.policy_parameters(), cfg.max_grad_norm),
                       "the one-step policy's gradient norm", "an FQL step", "lower actor_lr or raise fql_alpha")
        actor_opt.step()
        stats.update({"policy_loss": loss.item(), "distill": distill.item(), "q_pi": q_pi.mean().item()})
    agent.update_target(cfg.target_tau)
    return stats


def demo_decisions(agent: FQLAgent, episodes, gamma: float, reward_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The demos as chunk decisions every ``Ta`` steps, the replay's fields (``fql_update``): the window at ``t``, the
    executed actions ``a_{t:t+Ta}`` (normalised as the policy's), ``R = sum_{k<tau} gamma^k r_{t+k}`` with the sparse
    reward (1 at the first success, which terminates: ``bootstrap`` 0 there), else ``gamma^tau`` and the window at
    ``t + tau`` (a demo that ends without success is a truncation and bootstraps)."""
    Ta, To = agent.act_horizon, agent.obs_horizon
    dataset = ChunkDataset(episodes, To, agent.pred_horizon, gripper=not is_fast(agent.meta["env_id"]))
    rows = {k: [] for k in ("obs", "latent", "reward", "bootstrap", "next_obs")}
    for e, ep in enumerate(episodes):
        hits = ep.success.nonzero()[0]
        T = int(hits[0]) + 1 if len(hits) else len(ep)  # the steps the episode has under the sparse reward
        for t in range(0, T, Ta):
            tau = min(Ta, T - t)
            obs, actions = dataset.window(e, t - (To - 1))                       # [To, O], [H, A] raw
            terminal = bool(len(hits)) and t + tau == T
            rows["obs"].append(torch.as_tensor(obs))
            rows["latent"].append(torch.as_tensor(actions[To - 1:To - 1 + Ta]))
            rows["reward"].append(reward_scale * gamma ** (tau - 1) * float(terminal))
            rows["bootstrap"].append(0.0 if terminal else gamma ** tau)
            rows["next_obs"].append(torch.as_tensor(dataset.window(e, t + tau - (To - 1))[0]))
    out = {k: torch.stack(v).float() if k in ("obs", "latent", "next_obs") else torch.tensor(v)
           for k, v in rows.items()}
    with torch.no_grad():
        out["latent"] = agent.action_normalizer.normalize(out["latent"].to(agent.action_normalizer.shift.device)).cpu()
    return out


def replay_buffer(agent: FQLAgent, capacity: int) -> ReplayBuffer:
    """Chunk decisions: ``obs [To, O]``, ``latent`` = the executed actions ``[Ta, A]`` (normalised), ``reward``,
    ``bootstrap``, ``next_obs``."""
    return ReplayBuffer(capacity, (agent.obs_horizon, agent.obs_dim), (agent.act_horizon, agent.action_dim))


def optimizers(agent: FQLAgent, cfg):
    return (torch.optim.Adam(agent.policy_parameters(), lr=cfg.actor_lr),
            torch.optim.Adam(agent.value_parameters(), lr=cfg.critic_lr))


def fql_agent(policy, cfg) -> FQLAgent:
    """FQL's agent of ``cfg`` over the frozen stage-1 ``policy`` (``fql_offline`` trains it before RL)."""
    return FQLAgent(policy, cfg.num_inference_steps, tuple(cfg.fql_hidden_dims), tuple(cfg.value_hidden_dims),
                    cfg.act_horizon, cfg.obs_clip)


def start_demo_decisions(agent: FQLAgent, cfg, start: Path) -> dict[str, torch.Tensor]:
    """``demo_decisions`` of the demos the start checkpoint ``start`` was trained on."""
    return demo_decisions(agent, bc.training_demos(start), cfg.gamma, cfg.reward_scale)


@dataclass
class FQLSettings:
    """What ``fql_update`` and ``optimizers`` read, for an FQL phase outside stage 3 (notebook 02's offline row);
    ``Stage3Config`` carries the same fields."""

    fql_alpha: float
    actor_lr: float
    critic_lr: float
    target_tau: float
    max_grad_norm: float = 1.0


def train_offline(agent: FQLAgent, decisions: dict[str, torch.Tensor], steps: int, batch_size: int, cfg,
                  seed: int) -> dict[str, float]:
    """``steps`` updates (``fql_update``) on fixed chunk decisions (``demo_decisions``' fields), uniform batches of
    ``batch_size`` drawn with ``seed``; ``cfg`` is a ``Stage3Config`` or ``FQLSettings``.  Marks the agent offline-done
    and returns the last step's statistics."""
    buffer = replay_buffer(agent, len(decisions["reward"]))
    buffer.add(**decisions)
    actor_opt, critic_opt = optimizers(agent, cfg)
    gen, stats = torch.Generator().manual_seed(seed), {}
    torch.manual_seed(seed)
    for _ in progress.bar(steps, "FQL offline", unit="step", iterable=range(steps)):
        stats = fql_update(agent, buffer.sample(batch_size, gen), actor_opt, critic_opt, cfg)
    agent.offline_done.fill_(True)
    return stats


def fql_offline(agent: FQLAgent, cfg, start: Path) -> None:
    """FQL's offline phase in stage 3: ``fql_offline_steps`` updates (``train_offline``) on the start's demos as chunk
    decisions, batches of ``replay_batch_size``, seeded by ``cfg.seed``; runs once (the agent is marked)."""
    if cfg.fql_offline_steps == 0 or bool(agent.offline_done):
        return
    demos, t0 = start_demo_decisions(agent, cfg, start), time.time()
    stats = train_offline(agent, demos, cfg.fql_offline_steps, cfg.replay_batch_size, cfg, cfg.seed)
    print(f"FQL offline: {cfg.fql_offline_steps} steps on {len(demos['reward'])} demo decisions in {time.time() - t0:.0f} s; "
          f"last: q {stats['q']:.3f}, distill {stats['distill']:.4f}")


@torch.no_grad()
def collect(agent: FQLAgent, runner: ChunkRunner, buffer: ReplayBuffer, num_decisions: int,
            generator: torch.Generator | None = None) -> float:
    """``num_decisions`` decisions of every env with ``z ~ N(0, I)``, each stored in ``buffer``; returns the policy's
    share of the wall time."""
    policy_time = 0.0
    for _ in range(num_decisions):
        tp = time.time()
        window = runner.window.clone()
        o = agent.norm_obs(window)
        x = agent.chunk(o, torch.randn(len(o), agent.pred_horizon, agent.action_dim, generator=generator).to(o.device))
        start = agent.obs_horizon - 1
        executed = x[:, start:start + agent.act_horizon]                               # [N, Ta, A] normalised
        actions = agent.action_normalizer.unnormalize(executed).clamp(-1.0, 1.0).cpu()
        policy_time += time.time() - tp
        out = runner.step_chunk(actions)
        buffer.add(obs=window, latent=executed, reward=out["reward"],
                   bootstrap=out["discount"] * (~out["terminal"]).float(), next_obs=out["next_window"])
    return policy_time


def fql_learner(agent: FQLAgent, cfg) -> ReplayLearner:
    """FQL online: the replay starts with the start's demo decisions (``fql_offline``'s data), then each iteration adds
    ``rollout_steps`` decisions per env and takes ``replay_updates_per_decision`` steps per new decision."""
    buffer = replay_buffer(agent, cfg.replay_size)
    buffer.add(**start_demo_decisions(agent, cfg, policy_checkpoint(cfg.init_checkpoint, "init_checkpoint")))

    def make_collect(runner, generator):
        return lambda buf: collect(agent, runner, buf, cfg.rollout_steps, generator)

    def update_step(learner, batch, train_policy, i):
        return fql_update(agent, batch, learner.actor_opt, learner.critic_opt, cfg, train_policy)

    return ReplayLearner(agent, cfg, buffer, make_collect, update_step, optimizers,
                         lambda num_envs: cfg.rollout_steps * num_envs, "FQL")
