"""Stage 3's public API: the registry of fine-tuning methods, their flat configuration, and building, loading and
training an agent.

A method is a ``(steer, learner)`` pair: *what* RL moves and *how* it learns it.

    steer            what moves (the flow's weights stay frozen for every steer but "chain")
    chain            the velocity and noise nets, through the noisy denoising chain   (ReinFlow; flowlib.methods.reinflow)
    latent           a Gaussian policy over the chain's start x_0                      (DSRL; flowlib.methods.latent)
    residual         a bounded correction of a chunk's executed actions              (ResiP; flowlib.methods.residual)
    residual_step    a bounded correction of every executed action, closed loop      (RPL; flowlib.methods.residual_step)
    one_step         a one-step policy distilled from the frozen flow, against Q       (FQL; flowlib.methods.fql)
    gaussian         no flow: a Gaussian MLP cloned from the same demos, the baseline  (DPPO's; flowlib.methods.gaussian)

Each entry of ``METHODS`` names the config dataclasses the method reads (beyond ``flowlib.rl.loop.RunConfig``),
builds its agent from a stage-1/2 policy and its learner (``flowlib.rl.learners``) from the agent, and may add checks
of its own and a ``prepare`` step that fits a fresh agent to its start before RL (the Gaussian baseline's BC; not
run when a checkpoint's weights are loaded).  ``Stage3Config`` is the flat view papermill passes: every method's fields, of which a run may set
only those its method reads.  Adding a method: one module with its agent, config and builders, one entry here.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

from flowlib.envs.smdp import REACH_ENVS, ShapingConfig
from flowlib.infra import config
from flowlib.infra.config import (Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, check_fields,
                                   require)
from flowlib.infra.runs import policy_checkpoint
from flowlib.methods.fql import FQLConfig, fql_agent, fql_learner, fql_offline
from flowlib.methods.gaussian import GaussianConfig, gaussian_agent, gaussian_bc
from flowlib.methods.latent import LatentConfig, latent_agent
from flowlib.methods.latent_sac import SACConfig, latent_sac_agent, sac_learner
from flowlib.methods.reinflow import ChainConfig, ChunkScoreConfig, chain_agent, chain_ppo, chunk_ppo
from flowlib.methods.residual import ChunkResidualConfig, ResidualConfig, residual_agent
from flowlib.methods.residual_step_ppo import step_ppo_agent, step_ppo_learner
from flowlib.methods.residual_td3 import TD3Config, td3_agent, td3_learner
from flowlib.methods.rfc import RFCConfig, RFCLossConfig, RFCMaskConfig, rfc_beside, rfc_learner
from flowlib.policies import chunk_policy
from flowlib.policies.awsc import load_from_aw_shortcut_flow
from flowlib.rl import loop
from flowlib.rl.asymmetric import AsymmetricConfig, asymmetric_problem
from flowlib.rl.loop import ReplayConfig, RunConfig, read_agent_checkpoint
from flowlib.rl.ppo import PPOConfig

PER_STEP_ADVANTAGES = ("gae", "mc", "nstep")  # what PPO on a per-step residual estimates over env steps


@dataclass(frozen=True)
class Method:
    """One registered stage-3 method (module docstring)."""

    summary: str
    configs: tuple[type, ...]  # the config dataclasses it reads, beyond RunConfig
    agent: Callable  # (policy, cfg) -> agent
    learner: Callable  # (agent, cfg) -> a flowlib.rl.learners learner
    checks: Callable = lambda cfg: []  # cfg -> [(ok, message)]
    prepare: Callable = lambda agent, cfg, start: None  # fit a fresh agent to the start checkpoint before RL


def _no_branches(cfg) -> list[tuple[bool, str]]:
    return [(cfg.branches == 1, f"steer {cfg.steer!r} cannot branch (branches {cfg.branches}): branching tries "
             "several noisy chains from one state; use branches: 1 with another advantage")]


def _per_step_ppo(cfg) -> list[tuple[bool, str]]:
    return [(cfg.advantage in PER_STEP_ADVANTAGES,
             f"steer 'residual_step' with learner 'ppo' takes advantage {' / '.join(PER_STEP_ADVANTAGES)} over env "
             f"steps (got {cfg.advantage!r}: GRPO's episode groups and branches are chunk-decision estimators)"),
            *_no_branches(cfg)]


def _gaussian_checks(cfg) -> list[tuple[bool, str]]:
    return [(cfg.critic_input == "obs", f"steer 'gaussian' has no velocity net: critic_input must be 'obs', got "
             f"{cfg.critic_input!r}"), *_no_branches(cfg)]


def _rfc_checks(cfg) -> list[tuple[bool, str]]:
    return [(cfg.advantage in PER_STEP_ADVANTAGES, f"learner 'rfc' masks by advantages over a rollout: advantage must "
             f"be one of {' / '.join(PER_STEP_ADVANTAGES)}, got {cfg.advantage!r}"),
            (cfg.bc_coeff == 0, f"learner 'rfc' has no PPO loss for bc_coeff ({cfg.bc_coeff}) to weigh: its reflow is "
             "already a pull to its own chunks; leave bc_coeff out"), *_no_branches(cfg)]


def _fql_checks(cfg) -> list[tuple[bool, str]]:
    return [(cfg.reward == "sparse", f"learner 'fql' learns offline from the demos' sparse reward (1 at success, which "
             f"ends the episode): set reward: sparse (got {cfg.reward!r})")]


METHODS: dict[tuple[str, str], Method] = {
    ("chain", "ppo"): Method("ReinFlow: PPO through the noisy denoising chain (with rfc_lambda: RFC beside it)",
                             (ChainConfig, ChunkScoreConfig, PPOConfig, AsymmetricConfig, RFCMaskConfig, RFCLossConfig),
                             chain_agent, rfc_beside(chain_ppo)),
    ("latent", "ppo"): Method("DSRL's idea by PPO: a Gaussian policy over x_0, the flow frozen (with rfc_lambda: "
                              "reflowed in the same run)", (LatentConfig, ChunkScoreConfig, PPOConfig, RFCMaskConfig,
                                                            RFCLossConfig), latent_agent,
                              rfc_beside(functools.partial(chunk_ppo, name="latent PPO")), _no_branches),
    ("latent", "sac"): Method("DSRL: SAC over x_0 from a replay, KL-regularised to N(0, I)",
                              (LatentConfig, ReplayConfig, SACConfig), latent_sac_agent, sac_learner),
    ("residual", "ppo"): Method("PPO on a bounded correction of each chunk's executed actions",
                                (ResidualConfig, ChunkResidualConfig, ChunkScoreConfig, PPOConfig), residual_agent,
                                functools.partial(chunk_ppo, name="residual PPO"), _no_branches),
    ("residual_step", "td3"): Method("TD3 on a bounded correction of every executed action (the CPU target run)",
                                     (ResidualConfig, ReplayConfig, TD3Config, AsymmetricConfig), td3_agent, td3_learner),
    ("residual_step", "ppo"): Method("PPO on the same per-step correction, every env step a decision",
                                     (ResidualConfig, PPOConfig, AsymmetricConfig), step_ppo_agent, step_ppo_learner,
                                     _per_step_ppo),
    ("chain", "rfc"): Method("RFC: reflow the flow on its own rollouts' chunks, masked by success or advantage",
                             (ChainConfig, ChunkScoreConfig, PPOConfig, RFCMaskConfig, RFCConfig), chain_agent,
                             rfc_learner,
                             _rfc_checks),
    ("one_step", "fql"): Method("FQL: a one-step policy distilled from the flow against Q, offline on the demos, "
                                "then online", (FQLConfig, ReplayConfig), fql_agent, fql_learner, _fql_checks,
                                fql_offline),
    ("gaussian", "ppo"): Method("the baseline without a flow: a Gaussian MLP over the chunk, cloned, then PPO",
                                (GaussianConfig, ChunkScoreConfig, PPOConfig), gaussian_agent,
                                functools.partial(chunk_ppo, name="Gaussian PPO"), _gaussian_checks, gaussian_bc),
}
VISUAL_METHODS = (("chain", "ppo"), ("residual_step", "td3"), ("residual_step", "ppo"))  # on a visual stage-1 policy
METHOD_CONFIGS = tuple(dict.fromkeys(c for m in METHODS.values() for c in m.configs))  # every method's, once


@dataclass
class MethodChoice:
    """Which registered method runs (``flowlib.methods.stage3.METHODS``)."""

    steer: str = "chain"  # what RL moves: "chain", "latent", "residual", "residual_step", "one_step" (FQL), "gaussian"
    learner: str = "ppo"  # how: "ppo"; "sac" (latent); "td3" (residual_step); "rfc" (chain); "fql" (one_step)


@dataclass
class Stage3Config(AsymmetricConfig, FQLConfig, RFCLossConfig, RFCConfig, RFCMaskConfig, GaussianConfig, TD3Config,
                   SACConfig, ReplayConfig, PPOConfig, ChunkResidualConfig, ResidualConfig, LatentConfig,
                   ChunkScoreConfig, ChainConfig, MethodChoice, RunConfig):
    """The parameters of a stage-3 notebook, flat as papermill passes them: ``RunConfig``'s, the method choice,
    and every method's own (``METHODS``).  A field the chosen method does not read must stay at its default.
    Defaults are the short CPU run of chain ReinFlow."""

    RENAMED: ClassVar[dict[str, str]] = {"sac_batch_size": "replay_batch_size", "sac_buffer_size": "replay_size",
                                         "sac_updates_per_decision": "replay_updates_per_decision",
                                         "sac_tau": "target_tau", "norm_adv": "adv_norm"}

    def __post_init__(self):
        check_fields(self)
        method = METHODS.get((self.steer, self.learner))
        if method is None:
            pairs = ", ".join(f"{s}/{lr}" for s, lr in METHODS)
            raise ValueError(f"steer {self.steer!r} with learner {self.learner!r} is not a stage-3 method: choose "
                             f"one of (steer/learner) {pairs}")
        checks = [check for cls in method.configs for name in dir(cls) if name.endswith("_checks")
                  for check in getattr(self, name)()]
        require([*self.run_checks(), *checks, *method.checks(self), *self._unread_checks(method)])
        if self.learner == "ppo":
            require([((self.advantage == "branch") == (self.branches >= 2),
                      f"advantage 'branch' goes with branches >= 2 and branches >= 2 with advantage 'branch' "
                      f"(got advantage {self.advantage!r}, branches {self.branches}): set both"),
                     (self.advantage != "grpo" or self.num_envs % self.group_size == 0,
                      f"advantage 'grpo' needs num_envs ({self.num_envs}) to be a multiple of group_size "
                      f"({self.group_size})")])

    def _unread_checks(self, method: Method) -> list[tuple[bool, str]]:
        """One check per config group the method does not read: none of its fields away from its default."""
        out, default = [], config.defaults(type(self))  # notebook 06's SteeringConfig has defaults of its own
        for cls in METHOD_CONFIGS:
            if cls in method.configs:
                continue
            changed = [n for n in config.field_names(cls) if getattr(self, n) != default[n]]
            readers = [f"{s}/{lr}" for (s, lr), m in METHODS.items() if cls in m.configs]
            out.append((not changed, f"steer {self.steer!r} with learner {self.learner!r} does not read "
                        f"{', '.join(changed)} ({cls.__name__}, read by steer/learner {', '.join(readers)}): leave "
                        f"the key out or choose such a method"))
        return out


def method(cfg: Stage3Config) -> Method:
    return METHODS[(cfg.steer, cfg.learner)]


def parameter_groups(steer_learner: tuple[str, str] | None = None) -> list[tuple[str, list[str]]]:
    """Stage 3's fields grouped by the dataclass that declares them, each group headed by who reads it: the run's
    (``RunConfig``, every method), the method choice, then each method config with its readers.  With
    ``steer_learner`` only the groups that method reads: the options it shows (``python -m flowlib.run
    06_steering --show-params residual_step/td3``); an unknown pair is a ``ValueError`` naming the registered ones."""
    if steer_learner is not None and steer_learner not in METHODS:
        raise ValueError(f"no stage-3 method {'/'.join(steer_learner)!r}: choose one of (steer/learner) "
                         f"{', '.join(f'{s}/{lr}' for s, lr in METHODS)}")
    declared: dict[str, type] = {}
    for cls in (RunConfig, ShapingConfig, MethodChoice, *METHOD_CONFIGS):
        for name in cls.__annotations__:  # its own fields, not its bases'
            declared.setdefault(name, cls)
    groups = [(f"{RunConfig.__name__}: every method", RunConfig),
              (f"{ShapingConfig.__name__}: every method, on {', '.join(REACH_ENVS)} only", ShapingConfig),
              (f"{MethodChoice.__name__}: the method", MethodChoice)]
    for cls in METHOD_CONFIGS:
        if steer_learner is None or cls in METHODS[steer_learner].configs:
            readers = ", ".join(f"{s}/{lr}" for (s, lr), m in METHODS.items() if cls in m.configs)
            groups.append((f"{cls.__name__}: read by {readers}", cls))
    return [(heading, [n for n, owner in declared.items() if owner is cls]) for heading, cls in groups]


# --------------------------------------------------------------------------- the start, agents, checkpoints


def init_checkpoint_path(cfg: Stage3Config) -> Path:
    return policy_checkpoint(cfg.init_checkpoint, "init_checkpoint")


def start_problem(cfg: Stage3Config) -> str:
    """Why the start checkpoint cannot run ``cfg`` ("" if it can): checked before a run or a sweep starts,
    so a job that would fail is known when it is planned.  A start that does not exist yet is not checked
    (a sweep may be planned before stage 1 has run; the run itself then stops with "not found")."""
    try:
        path = init_checkpoint_path(cfg)
    except FileNotFoundError:
        return ""
    meta = chunk_policy.checkpoint_meta(path)
    if problem := chunk_policy.flow_problem(meta, path, "stage 3"):
        return problem
    if visual_problem(cfg, meta, path):
        return visual_problem(cfg, meta, path)
    if asymmetric_problem(cfg, meta):
        return f"{path}: {asymmetric_problem(cfg, meta)}"
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


def visual_problem(cfg: Stage3Config, meta: dict, path) -> str:
    """Why ``cfg``'s method cannot start from a visual policy (its ``meta``), or ""."""
    if meta.get("obs_mode", "state") == "state" or (cfg.steer, cfg.learner) in VISUAL_METHODS:
        return ""
    return (f"the start {path} reads {meta['obs_mode']} observations; of the stage-3 methods only "
            f"{', '.join(f'{s}/{lr}' for s, lr in VISUAL_METHODS)} (steer/learner) run on a visual policy (their "
            f"heads read the encoder's embedding, and a replay keeps the embedding, not the frames); the others keep "
            f"pixel windows in replay buffers or put MLP heads on them: start them from a state policy")


def make_agent(policy, cfg: Stage3Config, state_dim: int = 0):
    """The agent of ``cfg``'s method over a stage-1/2 ``policy``; ``state_dim``: the env's state width
    (``EnvSpec.state_dim``), which an asymmetric critic reads (``flowlib.rl.asymmetric``)."""
    if AsymmetricConfig in method(cfg).configs:
        return method(cfg).agent(policy, cfg, state_dim)
    return method(cfg).agent(policy, cfg)


def build_agent(cfg: Stage3Config, path: Path, spec=None) -> tuple:
    """Agent from a stage-1 or stage-2 checkpoint; with a stage-2 critic of the same value-net shape
    and ``warm_start_value``, ``V`` starts from the critic's.  Returns the agent and how V started."""
    policy, critic = load_from_aw_shortcut_flow(path, spec)
    chunk_policy.require_flow(policy.meta, path, "stage 3")
    if visual_problem(cfg, policy.meta, path):
        raise ValueError(visual_problem(cfg, policy.meta, path))
    agent = make_agent(policy, cfg, getattr(spec, "state_dim", 0))
    method(cfg).prepare(agent, cfg, path)
    how = "fresh"
    # steer "residual_step" learns Q(o, a_b, r) (TD3) or V(o, a_b) (PPO), not the window's V of a stage-2 critic
    # (and an asymmetric V reads the simulator's state, not the window)
    if (cfg.warm_start_value and cfg.critic_input == "obs" and not cfg.asymmetric_critic
            and cfg.steer != "residual_step" and critic is not None
            and hasattr(critic, "value_net") and hasattr(agent, "value_net")):
        try:
            agent.value_net.load_state_dict(critic.value_net.state_dict())
            how = f"stage-2 {critic.kind} V"
        except RuntimeError:
            how = "fresh (the stage-2 V has other sizes)"
    return agent, how


def checkpoint_config(ckpt: dict, overrides: dict | None = None) -> Stage3Config:
    """The config a stage-3 checkpoint ran with, with ``overrides`` (unknown keys and wrong types rejected).

    Older checkpoints are read as today's: renamed fields under their new names (``Stage3Config.RENAMED``; the
    residual steers' ``latent_hidden_dims`` as ``residual_hidden_dims``), and fields that the resulting method does
    not read left out (they changed nothing in the run, so nothing is lost)."""
    saved = dict(ckpt["config"])
    if "norm_adv" in saved:  # a bool before 2026-12-07; it standardised over the whole batch
        saved["norm_adv"] = "batch" if saved["norm_adv"] else "off"
    saved = {Stage3Config.RENAMED.get(k, k): v for k, v in saved.items()}
    if saved.get("steer", "chain").startswith("residual") and "residual_hidden_dims" not in saved:
        saved["residual_hidden_dims"] = saved.pop("latent_hidden_dims", [256, 256])  # written before the split
    saved.setdefault("obs_clip", 0.0)  # checkpoints from before obs_clip ran unclipped
    values = {**saved, **(overrides or {})}
    choice = METHODS.get((values.get("steer", "chain"), values.get("learner", "ppo")))
    read = {f.name for cls in (RunConfig, MethodChoice, *(choice.configs if choice else METHOD_CONFIGS))
            for f in dataclasses.fields(cls)}
    values = {k: v for k, v in values.items() if k in read or k in (overrides or {})}
    return config.validate(Stage3Config, values, "checkpoint config + overrides")


def _agent_from(ckpt: dict, cfg: Stage3Config):
    """The agent a read stage-3 checkpoint holds, rebuilt for ``cfg``, in eval mode."""
    state = ckpt["agent"].get("critic_obs_mean")  # an asymmetric critic's normaliser: [P]
    agent = make_agent(chunk_policy.build_policy(ckpt["meta"]), cfg, 0 if state is None else len(state))
    agent.load_state_dict(ckpt["agent"])
    return agent.eval()


def load_agent(path: str | Path, overrides: dict | None = None):
    """A fine-tuned agent from a stage-3 checkpoint (``last.pt`` / ``best_model.pt``), in eval mode.

    ``overrides`` change how the same weights sample and score (``noise_corr``, ``log_prob_over``, ``K`` ...)."""
    ckpt = read_agent_checkpoint(path)
    return _agent_from(ckpt, checkpoint_config(ckpt, overrides))


def load_for_rollouts(path: str | Path, overrides: dict | None = None, max_noise_std: float = 0.0):
    """``(checkpoint, config, agent, max_noise_std)`` for measuring a checkpoint (``benchmarks/``): ``load_agent``
    with the noise the run had at the checkpoint's env steps (its schedule), or ``max_noise_std`` when > 0."""
    ckpt = read_agent_checkpoint(path)
    cfg = checkpoint_config(ckpt, overrides)
    agent = _agent_from(ckpt, cfg)
    std = max_noise_std or loop.noise_schedule(cfg.noise_schedule, ckpt["env_steps"] / max(cfg.noise_decay_steps, 1),
                                               cfg.max_noise_std, cfg.final_noise_std)
    agent.set_max_noise_std(std)
    return ckpt, cfg, agent, std


def make_learner(agent, cfg: Stage3Config):
    """The learner (``flowlib.rl.learners``) of ``cfg``'s method for ``agent``."""
    return method(cfg).learner(agent, cfg)


def train(cfg: Stage3Config, agent, env, run_path: Path, tracker=None) -> dict:
    """Fine-tune ``agent`` by ``cfg``'s method in ``flowlib.rl.loop``'s loop; returns its summary."""
    return loop.train(cfg, agent, make_learner(agent, cfg), env, run_path, tracker)


@dataclass
class SteeringConfig(Stage3Config):
    """Notebook 06's parameters: ``Stage3Config`` with defaults for a short CPU run of the per-step residual learned
    by TD3 (the method of the target run, ``params/06_steering/cpu.yaml``, at a fraction of its size)."""

    steer: str = "residual_step"
    learner: str = "td3"
    reward: str = "dense"
    num_inference_steps: PositiveInt = 4
    residual_bound: PositiveFloat = 0.2
    residual_gripper: bool = False
    residual_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [64, 64])
    value_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [64, 64])
    min_noise_std: PositiveFloat = 0.005
    max_noise_std: PositiveFloat = 0.05
    final_noise_std: PositiveFloat = 0.05
    noise_schedule: str = "constant"
    replay_batch_size: PositiveInt = 64
    replay_updates_per_decision: PositiveFloat = 0.25
    total_env_steps: PositiveInt = 1024
    gamma: Fraction = 0.8
    actor_lr: NonNegativeFloat = 1e-4
    critic_lr: PositiveFloat = 3e-4
    critic_warmup_steps: NonNegativeInt = 256
    bench_num_envs: list[PositiveInt] = dataclasses.field(default_factory=lambda: [2])
    bench_decisions: PositiveInt = 2


@dataclass
class ChainPPOConfig(Stage3Config):
    """Notebook 03's parameters: ``Stage3Config`` with defaults for chain PPO on the fast task ``FastReach-v0`` from
    an MLP stage-1 start (``params/01_shortcut_bc/fast_reach_mlp.yaml``, made by the notebook when missing), at
    a fifth of ``params/03_reinflow/fast_reach_mlp.yaml``'s env steps and half its envs: a minute on 2 CPU cores."""

    init_checkpoint: str = "01_shortcut_bc/fast_reach_mlp/best_model.pt"
    env_id: str = "FastReach-v0"
    num_envs: PositiveInt = 512
    max_episode_steps: PositiveInt = 40
    num_inference_steps: PositiveInt = 4
    log_prob_over: str = "executed_last"
    max_noise_std: PositiveFloat = 0.1
    final_noise_std: PositiveFloat = 0.04
    min_noise_std: PositiveFloat = 0.02
    noise_decay_steps: NonNegativeInt = 10_000_000
    total_env_steps: PositiveInt = 2_457_600
    rollout_steps: PositiveInt = 10
    update_epochs: PositiveInt = 5
    minibatch_size: PositiveInt = 2048
    actor_lr: NonNegativeFloat = 1e-4
    critic_lr: PositiveFloat = 1e-3
    target_kl: NonNegativeFloat = 0.05
    critic_warmup_steps: NonNegativeInt = 81_920
    eval_every: NonNegativeInt = 10
    num_eval_episodes: PositiveInt = 512
    ckpt_every: PositiveInt = 10
    bench_num_envs: list[PositiveInt] = dataclasses.field(default_factory=lambda: [512])
    bench_decisions: PositiveInt = 4
    num_threads: NonNegativeInt = 0
    run_control: bool = True  # also train the flipped-advantage control, same budget and start (it must get worse)
