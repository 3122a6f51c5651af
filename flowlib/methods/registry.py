"""Stage 3's registry: every fine-tuning method, and the flat configuration that chooses one.

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
only those its method reads.  Adding a method: one module with its agent, config and builders, one entry in ``METHODS`` here.  ``flowlib.methods.stage3``
builds, loads and trains the agent of a ``Stage3Config``.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, ClassVar

from flowlib.envs.smdp import REACH_ENVS, ShapingConfig
from flowlib.infra import config
from flowlib.infra.config import check_fields, require
from flowlib.methods.fql import FQLConfig, fql_agent, fql_learner, fql_offline
from flowlib.methods.gaussian import GaussianConfig, gaussian_agent, gaussian_bc
from flowlib.methods.latent import LatentConfig, latent_agent
from flowlib.methods.latent_sac import SACConfig, latent_sac_agent, sac_learner
from flowlib.methods.reinflow import ChainConfig, ChunkScoreConfig, chain_agent, chain_ppo, chunk_ppo
from flowlib.methods.residual import ChunkResidualConfig, ResidualConfig, residual_agent
from flowlib.methods.residual_step_ppo import step_ppo_agent, step_ppo_learner
from flowlib.methods.residual_td3 import TD3Config, td3_agent, td3_learner
from flowlib.methods.rfc import RFCConfig, RFCLossConfig, RFCMaskConfig, rfc_beside, rfc_learner
from flowlib.rl.asymmetric import AsymmetricConfig
from flowlib.rl.loop import ReplayConfig, RunConfig
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


def _config_class(steer_learner: tuple[str, str], m: Method) -> type:
    """The dataclass of one method's own options: its config groups over ``MethodChoice`` and ``RunConfig``."""
    name = "".join(part.title() for part in "_".join(steer_learner).split("_")) + "Options"  # ChainPpoOptions
    return dataclasses.make_dataclass(name, [], bases=(*reversed(m.configs), MethodChoice, RunConfig),
                                      namespace={"__doc__": f"{'/'.join(steer_learner)}: {m.summary}",
                                                 "__module__": __name__})


METHOD_OPTIONS: dict[tuple[str, str], type] = {pair: _config_class(pair, m) for pair, m in METHODS.items()}
globals().update({cls.__name__: cls for cls in METHOD_OPTIONS.values()})  # importable by name, so an instance pickles


def method_options(cfg: Stage3Config):
    """``cfg`` as its method's own dataclass (``METHOD_OPTIONS``): the run's fields, the method choice and the groups
    the method reads, nothing else.  The builders get this, so a method that read an option it does not declare in
    ``METHODS`` would fail there (an ``AttributeError``), not run on another method's default."""
    cls = METHOD_OPTIONS[(cfg.steer, cfg.learner)]
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


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
