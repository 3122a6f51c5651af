"""ReinFlow (Zhang et al. 2025): PPO fine-tuning of a flow policy through its denoising chain.

The agent (``flowlib.reinflow_agent``: the denoising MDP, the noise net and the chain's exact log-likelihood,
ReinFlow Eq. 4-5) is trained here: its rollouts, configuration, training loop and checkpoints.

Chunks as a semi-MDP
--------------------
One decision executes ``act_horizon`` actions.  It earns ``R = sum_{k<tau} gamma^k r_{t+k}`` and
bootstraps with ``gamma^tau`` (``tau < act_horizon`` when the episode ends inside the chunk).  A
termination stops the bootstrap; a truncation (time limit) bootstraps from ``V`` of the last
observation (``flowlib.smdp.ChunkRunner`` steps the envs).  GAE runs over decisions with per-decision
discount ``gamma^tau``.

Everything here acts on normalised actions (the flow's space, roughly ``[-1, 1]``); the policy's
normalisers map to and from the env.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import bc, config, ppo
from .config import Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_fields, require
from .flow_sde import LOG_2PI, METHODS
from .ppo import explained_variance, gae, ppo_update  # noqa: F401  (the PPO toolkit lives in flowlib.ppo)
from .reinflow_agent import LOG_PROB_OVER, LOG_PROB_REDUCE, ReinFlowAgent
from .runs import load_torch, policy_checkpoint, rng_state, save_torch, set_rng_state
from .smdp import REACH_ENVS, REWARDS, ChunkRunner


# What RL moves: the velocity net through the noisy chain (ReinFlow), x_0 (flowlib.latent), a correction of the
# executed actions per decision (flowlib.residual) or per env step from the current observation (flowlib.residual_step)
STEER = ("chain", "latent", "residual", "residual_step")
RESIDUAL_PER = ("action", "chunk")  # steer "residual": one correction per executed action, or one for the chunk
# How: PPO (every steer; for "residual_step" each env step is a decision); SAC from a replay (steer "latent",
# flowlib.latent_sac); TD3 from a replay (steer "residual_step", flowlib.residual_step)
LEARNERS = ("ppo", "sac", "td3")
PER_STEP_ADVANTAGES = ("gae", "mc", "nstep")  # what PPO on steer "residual_step" estimates over env steps


def noise_schedule(kind: str, progress: float, init: float, final: float) -> float:
    """``max_noise_std`` at training ``progress`` in [0, 1] (ReinFlow's decaying exploration).

    constant: ``init``; linear: ``init + (final - init) p``; exp: ``final + (init - final) exp(-3p)``.
    """
    p = min(max(progress, 0.0), 1.0)
    if kind == "constant":
        return init
    if kind == "linear":
        return init + (final - init) * p
    if kind == "exp":
        return final + (init - final) * math.exp(-3.0 * p)
    raise ValueError(f"noise schedule must be 'constant', 'linear' or 'exp', got {kind!r}")


# --------------------------------------------------------------------------- SMDP buffer


@dataclass
class RolloutBuffer:
    """Chunk-level transitions of one PPO iteration, time-major ``[T, N, ...]``."""

    obs: torch.Tensor             # [T, N, To, O]   raw observation windows
    chains: torch.Tensor          # [T, N, K+1, H, A]
    stochastic: torch.Tensor      # [T, N, K]  bool: which denoising steps carried noise
    step_log_probs: torch.Tensor  # [T, N, K]
    log_probs: torch.Tensor       # [T, N]    joint
    values: torch.Tensor          # [T, N]
    rewards: torch.Tensor         # [T, N]  sum_{k<tau} gamma^k r
    discounts: torch.Tensor       # [T, N]  gamma^tau
    next_values: torch.Tensor     # [T, N]  V(s_{t+tau})
    terminal: torch.Tensor        # [T, N]  bool
    ends: torch.Tensor            # [T, N]  bool (terminated or truncated)
    weights: torch.Tensor         # [T, N]  1 = a live decision, 0 = an env idling after its episode (GRPO)
    policy_time: float = 0.0      # seconds of the rollout spent in the policy (chain, values)

    def flat(self, advantages: torch.Tensor, returns: torch.Tensor) -> dict[str, torch.Tensor]:
        n = self.rewards.numel()
        return {"obs": self.obs.reshape(n, *self.obs.shape[2:]), "chains": self.chains.reshape(n, *self.chains.shape[2:]),
                "stochastic": self.stochastic.reshape(n, -1), "step_log_probs": self.step_log_probs.reshape(n, -1),
                "log_probs": self.log_probs.reshape(n), "values": self.values.reshape(n), "weights": self.weights.reshape(n),
                "advantages": advantages.reshape(n), "returns": returns.reshape(n)}

    def advantages(self, cfg) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, returns)`` ``[T, N]`` by ``cfg.advantage`` (``flowlib.ppo``); returns are the value targets."""
        args = (self.rewards, self.next_values, self.discounts, self.terminal, self.ends)
        if cfg.advantage == "gae":
            return ppo.gae(self.rewards, self.values, self.next_values, self.discounts, self.terminal, self.ends,
                           cfg.gae_lambda)
        if cfg.advantage == "branch":  # [T, M*N]: Q_m = R_m + gamma^tau V(s'_m), leave-one-out over the M branches
            q = self.rewards + self.discounts * (~self.terminal) * self.next_values
            T, M = q.shape[0], cfg.branches
            adv = ppo.branch_advantages(q.reshape(T, M, -1).transpose(0, 1)).transpose(0, 1).reshape(T, -1)
            return adv, q
        if cfg.advantage == "nstep":
            returns = ppo.nstep_returns(*args, cfg.n_step)
            return returns - self.values, returns
        returns = ppo.mc_returns(*args)
        if cfg.advantage == "mc":
            return returns - self.values, returns
        # grpo: every env ran one episode from its group's seed; score = its discounted return
        before = torch.cumprod(torch.cat([torch.ones_like(self.discounts[:1]), self.discounts[:-1]]), 0)
        scores = (before * self.rewards * self.weights).sum(0)                               # [N]
        groups = torch.arange(scores.shape[0]) // cfg.group_size
        return ppo.grpo_advantages(scores, groups)[None].expand_as(self.rewards).clone(), returns


# --------------------------------------------------------------------------- configuration


@dataclass
class ReplayConfig:
    """The replay of the off-policy learners, ``"sac"`` (``flowlib.latent_sac``) and ``"td3"``
    (``flowlib.residual_step``)."""

    sac_batch_size: PositiveInt = 256
    sac_updates_per_decision: PositiveFloat = 1.0  # gradient steps per stored decision (one per env and decision; for
                                        # steer "residual_step" a decision is an env step): the UTD
    sac_buffer_size: PositiveInt = 200_000  # decisions kept in the replay buffer (the oldest are dropped)
    sac_tau: Fraction = 0.005           # Polyak rate of the target Q nets

    def replay_checks(self) -> list[tuple[bool, str]]:
        return [(self.sac_buffer_size >= self.sac_batch_size,
                 f"sac_buffer_size ({self.sac_buffer_size}) must hold at least one batch ({self.sac_batch_size})"),
                (self.sac_tau > 0, f"sac_tau must be in (0, 1], got {self.sac_tau}")]


@dataclass
class SACConfig:
    """DSRL's learner (``"sac"``, ``flowlib.latent_sac``): soft actor-critic over ``x_0`` with a KL to ``N(0, I)``."""

    sac_init_alpha: PositiveFloat = 1.0  # weight of KL(pi(x_0 | o) || N(0, I)) per dim in the actor's loss, at the start
    sac_alpha_lr: NonNegativeFloat = 3.0e-3  # 0: alpha stays at sac_init_alpha
    sac_target_kl: PositiveFloat = 0.1  # alpha moves so that the KL to the stage-1 policy's N(0, I) is this, per dim


@dataclass
class TD3Config:
    """TD3 on the per-step residual (``"td3"``, ``flowlib.residual_step``; ``ReplayConfig`` applies too)."""

    td3_target_noise: NonNegativeFloat = 0.05  # std of the target policy's smoothing noise (normalised action units)
    td3_noise_clip: NonNegativeFloat = 0.1  # ... clipped to +-td3_noise_clip
    td3_policy_delay: PositiveInt = 2   # critic steps per actor (and target) step
    td3_n_step: PositiveInt = 1         # the critics' target sums n rewards before it bootstraps
    residual_l2: NonNegativeFloat = 0.0  # the actor's loss adds residual_l2 * mean (r / b)^2: r stays 0 unless Q pays
    actor_lr_warmup_steps: NonNegativeInt = 0  # env steps past critic_warmup_steps over which the actor's lr
                                               # ramps from 0 to actor_lr (0: full at once)


# Fields that only some learners or steers read, {(the choice, its values that read them): fields}: set away from its
# default under another value, such a field would do nothing, so ReinFlowConfig rejects it.  A learner's fields are
# its dataclass's.
SCOPED_FIELDS = {
    ("learner", ("ppo",)): tuple(config.field_names(ppo.PPOConfig)),                        # flowlib.ppo's update
    ("learner", ("sac",)): tuple(config.field_names(SACConfig)),                             # DSRL's KL weight
    ("learner", ("td3",)): tuple(config.field_names(TD3Config)),
    ("learner", ("sac", "td3")): tuple(config.field_names(ReplayConfig)),                    # replay
    ("steer", ("latent",)): ("latent_bound",),
    ("steer", ("residual",)): ("residual_per",),
    ("steer", ("residual", "residual_step")): ("residual_bound",),
    ("steer", ("latent", "residual", "residual_step")): ("latent_hidden_dims",),             # their policy's MLP
}


def unread_fields(learner: str, steer: str) -> dict[tuple[str, tuple[str, ...]], tuple[str, ...]]:
    """The groups of ``SCOPED_FIELDS`` that this learner and steer do not read."""
    chosen = {"learner": learner, "steer": steer}
    return {group: names for group, names in SCOPED_FIELDS.items() if chosen[group[0]] not in group[1]}


@dataclass
class RunConfig:
    """The fields of a stage-3 run that are no single learner's: the start, the env and learning's reward, the
    denoising chain and its noise, what RL moves (``steer``) and by which ``learner``, the budget, evaluation and
    bookkeeping."""

    seed: NonNegativeInt = 0
    init_checkpoint: str = ""           # stage-1/2 best_model.pt, relative to outputs/; "" = 01_shortcut_bc/default
    env_id: str = "PickCube-v1"
    act_horizon: NonNegativeInt = 0     # actions executed per chunk decision; 0 = the init checkpoint's own
    num_envs: PositiveInt = 2
    max_episode_steps: PositiveInt = 100
    backend: str = "auto"
    reward: str = "sparse"              # "sparse": 1 on success, which terminates; "dense": normalized_dense;
                                        # "shaped": sparse + gamma * phi(s') - phi(s), phi = normalized_dense
    reward_scale: PositiveFloat = 1.0   # learning sees reward_scale * r (value targets of O(1)); logged returns are raw
    success_bonus: NonNegativeFloat = 0.0  # reward "dense": learning adds this per step while the task is solved
                                           # (dense pays a near-miss 0.5-0.8 per step, a success 1); not logged
    reach_weight: NonNegativeFloat = 0.0  # PickCube, reward "dense" / "shaped": learning's reward (dense) or potential
                                          # (shaped) adds reach_weight * (1 - tanh(reach_sharpness |cube - gripper|)),
                                          # 1 once grasped
    reach_sharpness: PositiveFloat = 5.0  # 1/m; 5 is ManiSkill's own reach term (0.85 at 3 cm); 20 (cpu.yaml's) makes
                                          # the last centimetres of the approach pay (0.46 at 3 cm, 0.80 at 1 cm)
    grasp_min_gap: NonNegativeFloat = 0.0  # PickCube, reward "dense" / "shaped": learning counts a grasp (is_grasped,
                                           # in the dense reward's grasp / place terms and the reach term) only while the
                                           # fingers are >= this far apart (m; the cube is 4 cm, a squeeze on its edge
                                           # closes them); 0 = the env's contact flag as is
    place_weight: NonNegativeFloat = 0.0  # PickCube, reward "dense" / "shaped": learning's reward (dense) or potential
                                          # (shaped) adds place_weight * (1 - tanh(place_sharpness |goal - cube|))
                                          # while the grasp counts: a place term steep in the last centimetres
    place_sharpness: PositiveFloat = 20.0  # 1/m; the dense reward's own place term is (1 - tanh(5 |goal - cube|)) / 5
    # the denoising MDP
    num_inference_steps: PositiveInt = 8  # K
    min_noise_std: PositiveFloat = 0.01
    max_noise_std: PositiveFloat = 0.3  # initial max; decays by noise_schedule to final_noise_std
    final_noise_std: PositiveFloat = 0.01
    noise_schedule: str = "linear"      # constant / linear / exp
    noise_decay_steps: NonNegativeInt = 512  # env steps over which max_noise_std decays
    include_initial_noise: bool = False
    log_prob_over: str = "chunk"        # "chunk" / "executed_last" (exact) or "executed" (biased): LOG_PROB_OVER
    # what PPO moves: "chain" (ReinFlow: the velocity net, through the noisy chain) or "latent" (flowlib.latent:
    # a Gaussian policy over x_0, the flow frozen, DSRL's idea; max/min/final_noise_std are then the latent's std)
    steer: str = "chain"
    freeze_obs_encoder: bool = False    # steer "chain": PPO leaves the velocity net's obs_encoder (a stage-1 policy
                                        # trained with obs_emb_dim > 0) as stage 1/2 left it and moves the rest
    latent_bound: PositiveFloat = 2.5   # steer "latent": |mu(o)| <= latent_bound per dim of x_0
    # the hidden layers of steer "latent"'s policy, also of steer "residual"'s and "residual_step"'s
    latent_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [256, 256])
    # steer "residual" (flowlib.residual): the flow frozen, PPO on a Gaussian correction r ~ N(mu(o, a_b), sigma^2)
    # added to the executed actions; max/min/final_noise_std are then sigma's bounds (normalised action units)
    residual_bound: PositiveFloat = 0.5  # |mu| <= residual_bound per dim (the normaliser's [-1, 1] is the demos' range)
    residual_per: str = "action"        # "action": r [Ta, A], one per executed action; "chunk": r [A], for all Ta
    residual_gripper: bool = True       # steers "residual" / "residual_step": False leaves the last action dim (the
                                        # gripper) to the base
    # steer "residual_step" (flowlib.residual_step): a correction r = mu(o_t, a_b) of every executed action from the
    # current observation (closed loop), learned off-policy with learner "td3" or on-policy with "ppo" (each env step a
    # decision); max_noise_std: r's exploration std
    # how: "ppo" (on-policy, every steer: ppo.PPOConfig), "sac" (steer "latent": DSRL's soft actor-critic over x_0
    # from a replay, a twin Q(o, x_0) of value_hidden_dims, the policy frozen while the Q nets warm up for
    # critic_warmup_steps: SACConfig, ReplayConfig) or "td3" (steer "residual_step": TD3Config, ReplayConfig)
    learner: str = "ppo"
    # the noise method (flowlib.flow_sde; notebook 04)
    noise_method: str = "reinflow"      # reinflow / flow_noise (learned std) / flow_sde / flow_cps (noise_level a)
    noise_level: NonNegativeFloat = 0.5  # a of flow_sde / flow_cps; scaled by the noise schedule like max_noise_std
    hybrid: bool = False                # one random stochastic step per sample, the rest ODE (hybrid ODE-SDE)
    log_prob_reduce: str = "sum"        # "sum" (exact joint log-prob), "mean" (over steps), "mean_dim" (per dim, ReinFlow's code)
    critic_input: str = "obs"           # "obs" (V_vlm analogue) or "velocity_features" (V_expert analogue)
    detach_critic_input: bool = True
    # training, whichever the learner
    total_env_steps: PositiveInt = 512
    rollout_steps: PositiveInt = 8      # decisions per env per iteration
    gamma: Fraction = 0.99
    actor_lr: PositiveFloat = 3e-5
    critic_lr: PositiveFloat = 1e-4
    max_grad_norm: PositiveFloat = 1.0
    obs_clip: NonNegativeFloat = 5.0    # normalised obs clipped to +-obs_clip (0: off); demos lie within +-7.2 std
    noise_corr: Fraction = 0.0          # correlation of a step's noise along the chunk's H actions, in [0, 1)
    critic_warmup_steps: NonNegativeInt = 128  # iterations that start within these env steps update only the value net
    value_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [256, 256])
    warm_start_value: bool = True       # from a stage-2 checkpoint's V (same inputs), when there is one
    # evaluation and bookkeeping
    eval_every: NonNegativeInt = 0      # iterations; 0 = only before and after
    num_eval_episodes: PositiveInt = 4
    val_seed: NonNegativeInt = 10_000   # env seeds of the periodic evaluations, which pick best_model.pt
    eval_seed: NonNegativeInt = 20_000  # env seeds of the before / after report (never used to pick a model)
    train_seed: NonNegativeInt = 2_000_000  # env seeds of training episodes start here
    ckpt_every: PositiveInt = 1         # iterations
    bench_num_envs: list[PositiveInt] = dataclasses.field(default_factory=lambda: [1, 2])  # throughput table
    bench_decisions: PositiveInt = 8    # chunk decisions per throughput measurement
    num_threads: NonNegativeInt = 1
    resume: bool = True
    run_name: str = "default"
    wandb_mode: str = "disabled"


@dataclass
class ReinFlowConfig(TD3Config, SACConfig, ReplayConfig, ppo.PPOConfig, RunConfig):
    """Parameters of notebook 03 (ReinFlow), flat as papermill passes them: ``RunConfig``'s, then each learner's own
    (``ppo.PPOConfig``, ``ReplayConfig``, ``SACConfig``, ``TD3Config``).  A field that the chosen learner or steer
    does not read must stay at its default (``SCOPED_FIELDS``).  Defaults are the short CPU run; the paper-size
    baseline (1M env steps, rollout 128, warm-up 5000 ...) is ``params/03_reinflow/baseline.yaml``."""

    def __post_init__(self):
        check_fields(self)
        require([
            *self.ppo_checks(),
            *self.replay_checks(),
            (self.reward in REWARDS, f"reward must be one of {REWARDS}, got {self.reward!r}"),
            (self.success_bonus == 0 or self.reward == "dense",
             f"success_bonus ({self.success_bonus}) applies to reward 'dense' only (got reward {self.reward!r}): "
             f"the sparse and shaped rewards already pay a success alone; set success_bonus: 0.0 or reward: dense"),
            (self.reach_weight == 0 or self.reward in ("dense", "shaped"),
             f"reach_weight ({self.reach_weight}) adds to the dense reward or the shaped reward's potential (got reward "
             f"{self.reward!r}): set reach_weight: 0.0 or reward: dense / shaped"),
            (self.grasp_min_gap == 0 or self.reward in ("dense", "shaped"),
             f"grasp_min_gap ({self.grasp_min_gap}) gates the grasp in the dense reward (got reward {self.reward!r}): "
             "set grasp_min_gap: 0.0 or reward: dense / shaped"),
            (self.grasp_min_gap == 0 or self.env_id in REACH_ENVS,
             f"grasp_min_gap reads PickCube-v1's finger joints (got env_id {self.env_id!r}): set grasp_min_gap: 0.0"),
            (self.reach_weight == 0 or self.env_id in REACH_ENVS,
             f"reach_weight reads the reach term out of the dense reward of {REACH_ENVS} (got env_id {self.env_id!r}): "
             f"set reach_weight: 0.0"),
            (self.place_weight == 0 or self.reward in ("dense", "shaped"),
             f"place_weight ({self.place_weight}) adds to the dense reward or the shaped reward's potential (got reward "
             f"{self.reward!r}): set place_weight: 0.0 or reward: dense / shaped"),
            (self.place_weight == 0 or self.env_id in REACH_ENVS,
             f"place_weight reads PickCube-v1's cube-to-goal offset (got env_id {self.env_id!r}): set place_weight: 0.0"),
            (self.noise_corr < 1, f"noise_corr must be in [0, 1) (0: independent), got {self.noise_corr}"),
            (self.log_prob_over in LOG_PROB_OVER, f"log_prob_over must be one of {LOG_PROB_OVER}, got {self.log_prob_over!r}"),
            (self.noise_schedule in ("constant", "linear", "exp"),
             f"noise_schedule must be 'constant', 'linear' or 'exp', got {self.noise_schedule!r}"),
            (self.min_noise_std <= min(self.max_noise_std, self.final_noise_std),
             f"need min_noise_std ({self.min_noise_std}) <= final_noise_std ({self.final_noise_std}) and "
             f"max_noise_std ({self.max_noise_std})"),
            (self.gamma > 0, "gamma must be in (0, 1]"),
            (self.noise_method in METHODS, f"noise_method must be one of {METHODS}, got {self.noise_method!r}"),
            (self.steer in STEER, f"steer must be one of {STEER}, got {self.steer!r}"),
            (not self.freeze_obs_encoder or self.steer == "chain",
             f"freeze_obs_encoder applies to steer 'chain' (got steer {self.steer!r}, which keeps the whole flow "
             f"frozen): set freeze_obs_encoder: false"),
            (self.residual_per in RESIDUAL_PER, f"residual_per must be one of {RESIDUAL_PER}, got {self.residual_per!r}"),
            (self.residual_gripper or self.steer in ("residual", "residual_step"),
             f"residual_gripper False is an option of steers 'residual' and 'residual_step' "
             f"(got steer {self.steer!r})"),
            (self.learner in LEARNERS, f"learner must be one of {LEARNERS}, got {self.learner!r}"),
            (self.learner != "sac" or self.steer == "latent",
             f"learner 'sac' learns a policy over x_0: it needs steer 'latent' (got steer {self.steer!r})"),
            (self.learner != "td3" or self.steer == "residual_step",
             f"learner 'td3' learns steer 'residual_step' (a correction at every env step), got steer {self.steer!r}: "
             f"set steer: residual_step, or learner: ppo"),
            (self.steer != "residual_step" or self.advantage in PER_STEP_ADVANTAGES,
             f"steer 'residual_step' with learner 'ppo' takes advantage {' / '.join(PER_STEP_ADVANTAGES)} over env "
             f"steps (got {self.advantage!r}: GRPO's episode groups and branches are chunk-decision estimators)"),
            (self.steer == "chain" or self.branches == 1,
             f"steer {self.steer!r} cannot branch (branches {self.branches}): branching tries several noisy chains "
             f"from one state, and this agent draws one Gaussian before its chain; use branches: 1 with another advantage"),
            (self.log_prob_reduce in LOG_PROB_REDUCE,
             f"log_prob_reduce must be one of {LOG_PROB_REDUCE}, got {self.log_prob_reduce!r}"),
            (self.critic_input in ("obs", "velocity_features"),
             f"critic_input must be 'obs' or 'velocity_features', got {self.critic_input!r}"),
            ((self.advantage == "branch") == (self.branches >= 2),
             f"advantage 'branch' goes with branches >= 2 and branches >= 2 with advantage 'branch' "
             f"(got advantage {self.advantage!r}, branches {self.branches}): set both"),
            (self.advantage != "grpo" or self.num_envs % self.group_size == 0,
             f"advantage 'grpo' needs num_envs ({self.num_envs}) to be a multiple of group_size ({self.group_size})"),
            *[(not changed, f"{what} {getattr(self, what)!r} ignores {', '.join(changed)} (read only by {what} "
               f"{' / '.join(map(repr, readers))}): leave the key out or set {what}")
              for (what, readers), changed in self._ignored_fields().items()],
            (abs(self.val_seed - self.eval_seed) >= self.num_eval_episodes,
             f"val_seed ({self.val_seed}) and eval_seed ({self.eval_seed}) episodes overlap: the report would be "
             f"scored on episodes that picked best_model.pt; keep them >= num_eval_episodes apart"),
        ])

    def _ignored_fields(self) -> dict[tuple[str, tuple[str, ...]], list[str]]:
        """The fields of each ``SCOPED_FIELDS`` group set away from their defaults where this config's learner or
        steer does not read them."""
        default = config.defaults(type(self))
        return {group: [n for n in names if getattr(self, n) != default[n]]
                for group, names in unread_fields(self.learner, self.steer).items()}


# --------------------------------------------------------------------------- rollouts


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
    """
    if branches > 1:
        return _collect_branches(agent, runner, num_decisions, generator, branches)
    device = next(agent.parameters()).device
    rows, policy_time, value = [], 0.0, None
    for _ in range(num_decisions):
        tp = time.time()
        window, weight = runner.window.to(device), runner.active.float()
        chain, log_prob, stochastic, step_lp = agent.sample(window, generator, return_steps=True)
        if value is None:
            value = agent.value(window)
        actions = agent.actions(chain).cpu()
        policy_time += time.time() - tp
        out = runner.step_chunk(actions, auto_reset)
        tp = time.time()
        next_value = agent.value(out["next_window"].to(device))  # V(s_{t+tau}); for an ended env, its last window
        value_after = next_value.clone()
        if auto_reset and out["end"].any():
            end = out["end"].to(device)
            value_after[end] = agent.value(runner.window.to(device)[end])  # the reset envs' first windows
        policy_time += time.time() - tp
        rows.append(_row(window, chain, stochastic, step_lp, log_prob, value, weight, out, next_value))
        value = value_after
    return RolloutBuffer(**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}, policy_time=policy_time)


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
        tail = torch.where(truncated, agent.value(out["next_window"].to(device)).cpu(), 0.0)
        total += discount * (out["reward"] + out["discount"] * tail)
        discount *= out["discount"]
    return total


# --------------------------------------------------------------------------- building, checkpoints, training

CHECKPOINT_FORMAT = "flowlib.reinflow/1"


def init_checkpoint_path(cfg: ReinFlowConfig) -> Path:
    return policy_checkpoint(cfg.init_checkpoint, "init_checkpoint")


@functools.lru_cache(maxsize=8)
def _start_meta(path: str, mtime: float) -> dict:  # a sweep plans dozens of jobs from one start checkpoint
    return bc.read_checkpoint(path)["meta"]


def start_problem(cfg: ReinFlowConfig) -> str:
    """Why the start checkpoint cannot run ``cfg`` ("" if it can): checked before a run or a sweep starts,
    so a job that would fail is known when it is planned.  A start that does not exist yet is not checked
    (a sweep may be planned before stage 1 has run; the run itself then stops with "not found")."""
    try:
        path = init_checkpoint_path(cfg)
    except FileNotFoundError:
        return ""
    meta = _start_meta(str(path), path.stat().st_mtime)
    if cfg.freeze_obs_encoder and not meta["obs_emb_dim"]:
        return (f"freeze_obs_encoder is set, but the start {path} has no obs_encoder (its U-Net reads the flat "
                f"observation window: stage 1 ran with obs_emb_dim 0): train stage 1 with obs_emb_dim > 0 "
                f"(e.g. -p obs_emb_dim=64) or set freeze_obs_encoder: false")
    max_steps = meta["shortcut_max_steps"]
    if cfg.num_inference_steps > max_steps:
        return (f"num_inference_steps = {cfg.num_inference_steps}, but the start {path} is a ShortCut trained "
                f"for at most {max_steps} steps: train it with shortcut_max_steps >= {cfg.num_inference_steps} "
                f"(params/01_shortcut_bc/gpu.yaml has 16) or use num_inference_steps <= {max_steps}")
    return ""


def _agent(policy, cfg: ReinFlowConfig) -> ReinFlowAgent:
    common = dict(log_prob_reduce=cfg.log_prob_reduce, critic_input=cfg.critic_input,
                  detach_critic_input=cfg.detach_critic_input, act_horizon=cfg.act_horizon, obs_clip=cfg.obs_clip,
                  include_initial_noise=cfg.include_initial_noise, log_prob_over=cfg.log_prob_over,
                  noise_method=cfg.noise_method, hybrid=cfg.hybrid, noise_corr=cfg.noise_corr)
    if cfg.steer == "latent":
        from .latent import LatentSteeringAgent  # it subclasses ReinFlowAgent
        from .latent_sac import LatentSACAgent

        args = (policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std, tuple(cfg.value_hidden_dims),
                cfg.latent_bound, tuple(cfg.latent_hidden_dims))
        if cfg.learner == "sac":
            return LatentSACAgent(*args, init_alpha=cfg.sac_init_alpha, **common)
        return LatentSteeringAgent(*args, **common)
    if cfg.steer == "residual_step":
        from .residual_step import StepResidualAgent, StepResidualPPOAgent  # they subclass ReinFlowAgent

        agent = StepResidualPPOAgent if cfg.learner == "ppo" else StepResidualAgent
        return agent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                     tuple(cfg.value_hidden_dims), cfg.residual_bound, tuple(cfg.latent_hidden_dims),
                     correct_gripper=cfg.residual_gripper, **common)
    if cfg.steer == "residual":
        from .residual import ResidualAgent  # it subclasses LatentSteeringAgent

        return ResidualAgent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                             tuple(cfg.value_hidden_dims), cfg.residual_bound, tuple(cfg.latent_hidden_dims),
                             cfg.residual_per, correct_gripper=cfg.residual_gripper, **common)
    return ReinFlowAgent(policy, cfg.num_inference_steps, cfg.min_noise_std, cfg.max_noise_std,
                         tuple(cfg.value_hidden_dims), noise_level=cfg.noise_level,
                         freeze_obs_encoder=cfg.freeze_obs_encoder, **common)


def build_agent(cfg: ReinFlowConfig, path: Path, spec=None) -> tuple[ReinFlowAgent, str]:
    """Agent from a stage-1 or stage-2 checkpoint; with a stage-2 critic of the same value-net shape
    and ``warm_start_value``, ``V`` starts from the critic's.  Returns the agent and how V started."""
    from .awsc import load_from_aw_shortcut_flow  # stage 2 imports bc; keep the import graph one-way

    policy, critic = load_from_aw_shortcut_flow(path, spec)
    agent = _agent(policy, cfg)
    how = "fresh"
    # steer "residual_step" learns Q(o, a_b, r) (TD3) or V(o, a_b) (PPO), not the window's V of a stage-2 critic
    if (cfg.warm_start_value and cfg.critic_input == "obs" and cfg.steer != "residual_step" and critic is not None
            and hasattr(critic, "value_net")):
        try:
            agent.value_net.load_state_dict(critic.value_net.state_dict())
            how = f"stage-2 {critic.kind} V"
        except RuntimeError:
            how = "fresh (the stage-2 V has other sizes)"
    return agent, how


def save_agent(path: Path, agent: ReinFlowAgent, actor_opt, critic_opt, cfg: ReinFlowConfig, iteration: int,
               runner: ChunkRunner, best: dict, **extra) -> Path:
    """The checkpoint (atomic): weights, optimisers, config, progress, RNG, and ``extra`` (SAC's replay buffer)."""
    return save_torch({"format": CHECKPOINT_FORMAT, "meta": agent.meta, "config": dataclasses.asdict(cfg),
                       "agent": agent.state_dict(), "actor_opt": actor_opt.state_dict(),
                       "critic_opt": critic_opt.state_dict(), "iteration": iteration, "env_steps": runner.env_steps,
                       "next_seed": runner.next_seed, "best": best, **rng_state(), **extra}, path)


def read_agent_checkpoint(path: str | Path) -> dict:
    ckpt = load_torch(path, "train one with notebook 03 (python -m flowlib.run 03_reinflow)")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a ReinFlow checkpoint (format {CHECKPOINT_FORMAT})")
    return {**ckpt, "meta": bc.complete_meta(ckpt["meta"])}


def checkpoint_config(ckpt: dict, overrides: dict | None = None) -> ReinFlowConfig:
    """The config a ReinFlow checkpoint ran with, with ``overrides`` (unknown keys and wrong types rejected).

    The checkpoint's fields that the resulting learner or steer ignores (``SCOPED_FIELDS``; an override may change
    either, and older runs could set them) are left out: they changed nothing in the run, so nothing is lost."""
    values = {"obs_clip": 0.0, **ckpt["config"], **(overrides or {})}  # checkpoints from before obs_clip ran unclipped
    unread = unread_fields(values.get("learner", "ppo"), values.get("steer", "chain")).values()
    ignored = {name for names in unread for name in names}
    values = {k: v for k, v in values.items() if k not in ignored or k in (overrides or {})}
    return config.validate(ReinFlowConfig, values, "checkpoint config + overrides")


def load_agent(path: str | Path, overrides: dict | None = None) -> ReinFlowAgent:
    """A fine-tuned agent from a ReinFlow checkpoint (``last.pt`` / ``best_model.pt``), in eval mode.

    ``overrides`` change how the same weights sample and score (``noise_corr``, ``log_prob_over``, ``K`` ...)."""
    ckpt = read_agent_checkpoint(path)
    agent = _agent(bc.build_policy(ckpt["meta"]), checkpoint_config(ckpt, overrides))
    agent.load_state_dict(ckpt["agent"])
    return agent.eval()


def load_for_rollouts(path: str | Path, overrides: dict | None = None, max_noise_std: float = 0.0):
    """``(checkpoint, config, agent, max_noise_std)`` for measuring a checkpoint (``benchmarks/``): ``load_agent``
    with the noise the run had at the checkpoint's env steps (its schedule), or ``max_noise_std`` when > 0."""
    ckpt = read_agent_checkpoint(path)
    cfg = checkpoint_config(ckpt, overrides)
    agent = load_agent(path, overrides)
    std = max_noise_std or noise_schedule(cfg.noise_schedule, ckpt["env_steps"] / max(cfg.noise_decay_steps, 1),
                                          cfg.max_noise_std, cfg.final_noise_std)
    agent.set_max_noise_std(std)
    return ckpt, cfg, agent, std


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


def decisions_per_iteration(cfg: ReinFlowConfig, act_horizon: int) -> int:
    """Chunk decisions per env per iteration: ``rollout_steps``, or one whole episode for GRPO."""
    return math.ceil(cfg.max_episode_steps / act_horizon) if cfg.advantage == "grpo" else cfg.rollout_steps


def env_steps_per_iteration(cfg: ReinFlowConfig, num_envs: int, act_horizon: int) -> int:
    """Simulator steps of one iteration's rollout, every branch's included."""
    return decisions_per_iteration(cfg, act_horizon) * num_envs * act_horizon * cfg.branches


def in_critic_warmup(steps_before: int, cfg: ReinFlowConfig) -> bool:
    """Whether the iteration that starts after ``steps_before`` env steps updates only the value net.

    It does if it starts within the first ``critic_warmup_steps`` env steps: ceil(N / steps per iteration)
    iterations, so the policy learns from none of the first N env steps (an iteration that only *ended*
    by step N would round down, and N below one iteration would mean no warm-up at all)."""
    return steps_before < cfg.critic_warmup_steps


def episode_stats(episodes: list[dict]) -> dict[str, float]:
    """The ``train/...`` means of a log row over the episodes that ended (``ChunkRunner.pop_finished``)."""
    if not episodes:
        return {}
    return {"train/success_once": float(np.mean([e["success_once"] for e in episodes])),
            "train/return": float(np.mean([e["return"] for e in episodes])),
            "train/episode_length": float(np.mean([e["length"] for e in episodes])),
            **{f"train/{k}": float(np.mean([e[k] for e in episodes])) for k in episodes[0]
               if k.endswith("_once") and k != "success_once"}}


def validate(agent: ReinFlowAgent, env, cfg: ReinFlowConfig, runner: ChunkRunner, row: dict) -> float:
    """The periodic evaluation of the deterministic policy on the ``val_seed`` episodes (they pick
    ``best_model.pt``): adds ``eval/...`` to ``row``, restarts the training episodes, returns success_once."""
    result = bc.evaluate(agent, env, cfg.num_eval_episodes, cfg.num_inference_steps, seed=cfg.val_seed)
    runner.restart()
    row.update({"eval/success_once": result["success_once"], "eval/success_at_end": result["success_at_end"],
                "eval/return": result["return"],
                **{f"eval/{name}_once": rate for name, rate in result["flags_once"].items()}})
    return result["success_once"]


def end_iteration(cfg: ReinFlowConfig, agent: ReinFlowAgent, env, runner: ChunkRunner, row: dict, best: dict,
                  iteration: int, num_iters: int, run_path: Path, actor_opt, critic_opt, tracker=None,
                  extra=None) -> dict:
    """What ends an iteration after its update: every ``eval_every`` iterations the validation (``best_model.pt``
    when it beats ``best``), the log row, and every ``ckpt_every`` iterations ``last.pt``, with what ``extra()``
    returns in it (SAC's replay buffer).  Returns ``best``, updated."""
    if cfg.eval_every and (iteration + 1) % cfg.eval_every == 0 and iteration + 1 < num_iters:
        success = validate(agent, env, cfg, runner, row)
        if success > best["success_once"]:
            best = {"success_once": success, "env_steps": runner.env_steps}
            save_agent(run_path / "best_model.pt", agent, actor_opt, critic_opt, cfg, iteration + 1, runner, best)
    if tracker is not None:
        tracker.log(row, runner.env_steps)
    if (iteration + 1) % cfg.ckpt_every == 0 or iteration + 1 == num_iters:
        save_agent(run_path / "last.pt", agent, actor_opt, critic_opt, cfg, iteration + 1, runner, best,
                   **(extra() if extra else {}))
    return best


def prepare_run(cfg: ReinFlowConfig, agent: ReinFlowAgent, run_path: Path) -> Path:
    """The run folder, the global seed, and the agent on the GPU when there is one."""
    run_path = Path(run_path)
    run_path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        # TF32 convolutions/matmuls perturb re-scored log-probs of a K x H x A-dim chain by far more than
        # float32 does: the PPO ratio would start away from 1 (and the check in ppo_update would stop the run)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    agent.to(device)
    return run_path


def resume(cfg: ReinFlowConfig, agent: ReinFlowAgent, last: Path, actor_opt, critic_opt, env, tracker=None):
    """``(iteration, runner, best, checkpoint)`` to go on from: ``last`` when ``cfg.resume`` and it exists (agent,
    optimisers, RNG, env seeds and the tracker rewound to it; ``checkpoint`` is its dict), else a fresh start
    (``checkpoint`` None)."""
    start, next_seed, env_steps, best, ckpt = 0, cfg.train_seed, 0, {"success_once": -1.0, "env_steps": 0}, None
    if cfg.resume and last.exists():
        ckpt = read_agent_checkpoint(last)
        if ckpt["meta"] != agent.meta:
            raise ValueError(f"{last} belongs to another policy; use another run_name or resume=False")
        was = {k: ckpt["config"].get(k, default) for k, default in (("steer", "chain"), ("learner", "ppo"))}
        if was != {"steer": cfg.steer, "learner": cfg.learner}:
            raise ValueError(f"{last} is a run with {was}, this one has steer {cfg.steer!r} and learner "
                             f"{cfg.learner!r}: use another run_name or resume=False")
        agent.load_state_dict(ckpt["agent"])
        actor_opt.load_state_dict(ckpt["actor_opt"])
        critic_opt.load_state_dict(ckpt["critic_opt"])
        set_rng_state(ckpt)
        start, next_seed, env_steps, best = ckpt["iteration"], ckpt["next_seed"], ckpt["env_steps"], ckpt["best"]
        if tracker is not None:
            tracker.rewind(env_steps)
        print(f"resumed from {last} at iteration {start} ({env_steps} env steps)")
    runner = learning_runner(cfg, env, agent.obs_horizon, next_seed)
    runner.env_steps = env_steps
    return start, runner, best, ckpt


def learning_runner(cfg: ReinFlowConfig, env, obs_horizon: int, first_seed: int) -> ChunkRunner:
    """The ``ChunkRunner`` that pays ``cfg``'s learning reward (its kind, scale, bonus and PickCube's reach, grasp
    and place terms), with episodes from ``first_seed`` on: what a run trains on, and what a benchmark of its
    checkpoint must score with."""
    return ChunkRunner(env, obs_horizon, cfg.gamma, cfg.reward, first_seed=first_seed,
                       reward_scale=cfg.reward_scale, success_bonus=cfg.success_bonus,
                       reach_weight=cfg.reach_weight, grasp_min_gap=cfg.grasp_min_gap,
                       place_weight=cfg.place_weight, place_sharpness=cfg.place_sharpness,
                       reach_sharpness=cfg.reach_sharpness)


def train(cfg: ReinFlowConfig, agent: ReinFlowAgent, env, run_path: Path, tracker=None) -> dict:
    """ReinFlow: PPO on the noisy denoising chain, chunks as a semi-MDP (ReinFlow Alg. 1); with steer
    ``"residual_step"``, PPO on the per-step residual, every env step a decision (``flowlib.residual_step``).

    Each iteration: set ``max_noise_std`` from the schedule, collect ``rollout_steps`` decisions
    per env, GAE, then PPO (value net only in iterations that start before ``critic_warmup_steps``).  Every
    ``eval_every`` iterations the deterministic chain is evaluated on ``val_seed`` episodes, which pick
    ``best_model.pt`` (the training episodes restart afterwards); ``eval_seed`` stays for the report.
    ``last.pt`` (atomic) every ``ckpt_every`` iterations; with ``resume`` a run continues from it.  Returns ``{"best": ..., "iterations": ...}``.
    """
    if cfg.learner == "sac":
        from .latent_sac import train as train_sac  # it imports this module

        return train_sac(cfg, agent, env, run_path, tracker)
    if cfg.learner == "td3":
        from .residual_step import train as train_td3  # it imports this module

        return train_td3(cfg, agent, env, run_path, tracker)
    run_path = prepare_run(cfg, agent, run_path)
    # Adam rescales each coordinate by its own gradient noise; SGD keeps the gradient's direction
    optimizer = torch.optim.Adam if cfg.actor_optimizer == "adam" else torch.optim.SGD
    actor_opt = optimizer(agent.policy_parameters(), lr=cfg.actor_lr)
    critic_opt = torch.optim.Adam(agent.value_parameters(), lr=cfg.critic_lr)
    per_iter = env_steps_per_iteration(cfg, env.num_envs, agent.act_horizon)
    num_iters = max(1, math.ceil(cfg.total_env_steps / per_iter))
    last = run_path / "last.pt"
    start, runner, best, _ = resume(cfg, agent, last, actor_opt, critic_opt, env, tracker)
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + start)
    steps, learner = None, agent
    if cfg.steer == "residual_step":  # every env step is a decision (flowlib.residual_step, StepResidualPPOAgent)
        from .residual_step import StepCollector  # it imports this module

        steps, learner = StepCollector(agent, runner, gen, n_step=0), agent.ppo_view()
    bar = tqdm(total=num_iters, initial=start, desc="ReinFlow", mininterval=10)
    for iteration in range(start, num_iters):
        max_std = noise_schedule(cfg.noise_schedule, runner.env_steps / max(cfg.noise_decay_steps, 1),
                                 cfg.max_noise_std, cfg.final_noise_std)
        agent.set_max_noise_std(max_std)
        agent.set_noise_level(cfg.noise_level * max_std / cfg.max_noise_std)  # flow_sde / flow_cps: same schedule
        agent.eval()
        t0 = time.time()
        grpo = cfg.advantage == "grpo"
        if grpo:  # one episode per env; the envs of a group start from the same seed
            G = cfg.group_size
            runner.restart([runner.next_seed + i // G for i in range(env.num_envs)])
            runner.next_seed += env.num_envs // G
        steps_before = runner.env_steps
        if steps is not None:  # rollout_steps x Ta env steps per env, as TD3's iterations
            buf = steps.rollout(cfg.rollout_steps * agent.act_horizon)
        else:
            buf = collect(agent, runner, decisions_per_iteration(cfg, agent.act_horizon), gen, auto_reset=not grpo,
                          branches=cfg.branches)
        rollout_time = time.time() - t0
        advantages, returns = buf.advantages(cfg)
        warmup = in_critic_warmup(steps_before, cfg)
        agent.train()
        t1 = time.time()
        stats = ppo_update(learner, buf.flat(advantages, returns), actor_opt, critic_opt, cfg,
                           train_policy=not warmup, generator=gen)
        update_time = time.time() - t1
        episodes = runner.pop_finished()
        row = {"iteration": iteration + 1, "max_noise_std": max_std, "critic_warmup": float(warmup),
               "episodes": len(episodes), "rollout_time": rollout_time, "rollout_policy_time": buf.policy_time,
               "update_time": update_time,
               "env_steps_per_s": per_iter / max(rollout_time, 1e-9),
               "explained_variance": explained_variance(buf.values[buf.weights > 0], returns[buf.weights > 0]), **stats}
        if "entropy" in stats:  # geometric-mean noise std from the Gaussian entropy
            row["noise_std"] = math.exp(stats["entropy"] - 0.5 * (1 + LOG_2PI))
        row.update(episode_stats(episodes))
        best = end_iteration(cfg, agent, env, runner, row, best, iteration, num_iters, run_path, actor_opt, critic_opt,
                             tracker)
        bar.update()
    bar.close()
    agent.eval()
    return {"best": best, "iterations": num_iters, "env_steps": runner.env_steps}


# --------------------------------------------------------------------------- benchmarks


def peak_memory_mb() -> float:
    """Peak GPU memory (CUDA) or peak resident memory of this process (CPU), in MiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def overhead(agent: ReinFlowAgent, env, decisions: int = 8, seed: int = 0) -> dict[str, float]:
    """Time per env step of the raw simulator (random actions) vs of the policy's share in the loop
    (``collect``: noisy chain sampling, values, bookkeeping; for steer ``residual_step`` its ``StepCollector``: the
    base chunks and a correction per env step), from ``decisions`` chunk decisions of each."""
    N, Ta = env.num_envs, agent.act_horizon
    steps = decisions * Ta * N
    env.reset(seed=seed)
    raw = 0.0
    for i in range(decisions * Ta):
        action = torch.rand(N, env.spec.action_dim, device=env.device) * 2 - 1
        t0 = time.time()
        _, _, term, trunc, _ = env.step(action)
        raw += time.time() - t0
        if (term | trunc).any():  # past the time limit: new episodes (not timed)
            env.reset(seed=seed + i + 1)
    raw /= steps
    runner = ChunkRunner(env, agent.obs_horizon, 0.99, first_seed=seed)
    t0 = time.time()
    if getattr(agent, "STEER", "") == "residual_step":  # its rollout: a correction per env step (flowlib.residual_step)
        from .residual_step import StepCollector, replay_buffer

        policy_time = StepCollector(agent, runner, torch.Generator().manual_seed(seed)).collect(
            replay_buffer(agent, steps), decisions * Ta)
    else:
        policy_time = collect(agent, runner, decisions, torch.Generator().manual_seed(seed)).policy_time
    total = time.time() - t0
    return {"num_envs": N, "raw_step_ms": 1e3 * raw, "policy_ms_per_env_step": 1e3 * policy_time / steps,
            "overhead_fraction": (policy_time / steps) / raw, "loop_env_steps_per_s": steps / total}
