"""Stage 3's public API: building, loading and training the agent of a ``Stage3Config``, and the notebooks' configs.

The registry of methods, ``(steer, learner)`` pairs, and the flat ``Stage3Config`` that chooses one live in
``flowlib.methods.registry`` and are read here under the same names (``stage3.METHODS``, ``stage3.Stage3Config``).
Adding a method: one module with its agent, config and builders, one entry in ``registry.METHODS``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from flowlib.infra import config
from flowlib.infra.config import Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from flowlib.infra.runs import policy_checkpoint
from flowlib.methods.registry import (  # noqa: F401
    METHOD_CONFIGS,
    METHODS,
    VISUAL_METHODS,
    Method,
    MethodChoice,
    Stage3Config,  # stage3.<name>, as before the move
    method,
    method_options,
    parameter_groups,
)
from flowlib.policies import chunk_policy
from flowlib.policies.awsc import load_from_aw_shortcut_flow
from flowlib.rl import loop
from flowlib.rl.asymmetric import AsymmetricConfig, asymmetric_problem
from flowlib.rl.loop import RunConfig, read_agent_checkpoint

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
    """The agent of ``cfg``'s method over a stage-1/2 ``policy``, built from the method's own options
    (``method_options``); ``state_dim``: the env's state width (``EnvSpec.state_dim``), which an asymmetric critic
    reads (``flowlib.rl.asymmetric``)."""
    m, options = method(cfg), method_options(cfg)
    return m.agent(policy, options, state_dim) if AsymmetricConfig in m.configs else m.agent(policy, options)


def build_agent(cfg: Stage3Config, path: Path, spec=None) -> tuple:
    """Agent from a stage-1 or stage-2 checkpoint; with a stage-2 critic of the same value-net shape
    and ``warm_start_value``, ``V`` starts from the critic's.  Returns the agent and how V started."""
    policy, critic = load_from_aw_shortcut_flow(path, spec)
    chunk_policy.require_flow(policy.meta, path, "stage 3")
    if visual_problem(cfg, policy.meta, path):
        raise ValueError(visual_problem(cfg, policy.meta, path))
    agent = make_agent(policy, cfg, getattr(spec, "state_dim", 0))
    method(cfg).prepare(agent, method_options(cfg), path)
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
    """The learner (``flowlib.rl.learners``) of ``cfg``'s method for ``agent``, built from the method's own options."""
    return method(cfg).learner(agent, method_options(cfg))


def train(cfg: Stage3Config, agent, env, run_path: Path, tracker=None) -> dict:
    """Fine-tune ``agent`` by ``cfg``'s method in ``flowlib.rl.loop``'s loop; returns its summary."""
    return loop.train(cfg, agent, make_learner(agent, cfg), env, run_path, tracker)


@dataclass
class FastReachRun(Stage3Config):
    """The run size both stage-3 tutorials default to (notebooks 03 and 06): ``FastReach-v0``'s 40-step episodes in
    512 envs, 10 decisions per env per iteration (5 chunks of 8 per episode), minibatches of 2,048, a critic at lr
    1e-3 with two warm-up iterations, validation on 512 episodes and ``last.pt`` every 10 iterations."""

    env_id: str = "FastReach-v0"
    num_envs: PositiveInt = 512
    max_episode_steps: PositiveInt = 40
    num_inference_steps: PositiveInt = 4
    rollout_steps: PositiveInt = 10
    minibatch_size: PositiveInt = 2048
    critic_lr: PositiveFloat = 1e-3
    critic_warmup_steps: NonNegativeInt = 81_920
    eval_every: NonNegativeInt = 10
    num_eval_episodes: PositiveInt = 512
    ckpt_every: PositiveInt = 10
    bench_num_envs: list[PositiveInt] = dataclasses.field(default_factory=lambda: [512])
    bench_decisions: PositiveInt = 4


@dataclass
class SteeringConfig(FastReachRun):
    """Notebook 06's parameters: ``Stage3Config`` with defaults for DSRL's x_0 steering by PPO (``steer: latent``) on
    ``FastReachRun`` from notebook 01's default clone, at ``params/06_steering/fast_push_dsrl.yaml``'s settings for 30
    iterations: half a minute on 2 CPU cores. The per-step residual's fields keep the settings of its PickCube target
    run (``params/06_steering/cpu.yaml``); learner ``ppo``, the sparse reward, gamma 0.99 and V's [256, 256] are
    ``Stage3Config``'s own."""

    steer: str = "latent"
    residual_bound: PositiveFloat = 0.2
    residual_gripper: bool = False
    residual_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [64, 64])
    min_noise_std: PositiveFloat = 0.05
    max_noise_std: PositiveFloat = 1.0
    final_noise_std: PositiveFloat = 1.0
    noise_schedule: str = "constant"
    replay_batch_size: PositiveInt = 64
    replay_updates_per_decision: PositiveFloat = 0.25
    total_env_steps: PositiveInt = 1_228_800
    update_epochs: PositiveInt = 8
    actor_lr: NonNegativeFloat = 3e-4
    target_kl: NonNegativeFloat = 0.1
    kl_stop: str = "policy"


@dataclass
class ChainPPOConfig(FastReachRun):
    """Notebook 03's parameters: ``Stage3Config`` with defaults for chain PPO on ``FastReachRun`` from an MLP stage-1
    start (``params/01_shortcut_bc/fast_reach_mlp.yaml``, made by the notebook when missing), at a fifth of
    ``params/03_reinflow/fast_reach_mlp.yaml``'s env steps and half its envs: a minute on 2 CPU cores."""

    init_checkpoint: str = "01_shortcut_bc/fast_reach_mlp/best_model.pt"
    log_prob_over: str = "executed_last"
    max_noise_std: PositiveFloat = 0.1
    final_noise_std: PositiveFloat = 0.04
    min_noise_std: PositiveFloat = 0.02
    noise_decay_steps: NonNegativeInt = 10_000_000
    total_env_steps: PositiveInt = 2_457_600
    update_epochs: PositiveInt = 5
    actor_lr: NonNegativeFloat = 1e-4
    target_kl: NonNegativeFloat = 0.05
    num_threads: NonNegativeInt = 0
    run_control: bool = True  # also train the flipped-advantage control, same budget and start (it must get worse)
