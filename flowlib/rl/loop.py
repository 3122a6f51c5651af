"""Stage 3's RL core: one training loop for every method, its run configuration, checkpoints and resuming.

A stage-3 run alternates a rollout and an update (ReinFlow Alg. 1; SAC and TD3 alike):

    for each iteration:
        exploration std <- noise_schedule(env steps)                      (the method's noise: chain, x_0 or residual)
        data   <- learner.collect(runner)                                 (decisions or env steps of every env)
        stats  <- learner.update(data, train_policy = not critic warm-up)  (PPO on the rollout, or replay steps)
        every eval_every: validation on val_seed episodes -> best_model.pt
        every ckpt_every: last.pt (atomic; with the learner's state, e.g. its replay), so the run resumes

The loop knows the agent only through ``set_max_noise_std`` and ``act`` (for validation), and the learner through
``flowlib.rl.learners``' protocol: it knows nothing of any stage-3 method.  Methods and their registry are in
``flowlib.methods.stage3``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flowlib.envs.smdp import REWARDS, ChunkRunner, ShapingConfig
from flowlib.infra import progress
from flowlib.infra.config import Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from flowlib.infra.runs import load_torch, rng_state, save_torch, set_rng_state
from flowlib.infra.schedules import LR_SCHEDULES, NOISE_SCHEDULES, lr_factor, noise_schedule  # noqa: F401  (kept as loop.<name>)
from flowlib.policies import bc, chunk_policy

CHECKPOINT_FORMAT = "flowlib.reinflow/1"  # every stage-3 checkpoint, whatever its method (the name is historical)


@dataclass
class RunConfig(ShapingConfig):
    """What every stage-3 run has, whatever its method: the start, the env and learning's reward, the exploration
    schedule, the budget, evaluation and bookkeeping; PickCube's reward terms are its base's (``ShapingConfig``)."""

    seed: NonNegativeInt = 0  # the run's seed (nets, noise, minibatches)
    init_checkpoint: str = ""  # stage-1/2 best_model.pt, relative to outputs/; "": 01_shortcut_bc/default
    env_id: str = "PickCube-v1"  # the task: ManiSkill's, Meta-World's v3 name or a fast torch task (FastReach-v0); the start checkpoint's task
    act_horizon: NonNegativeInt = 0  # actions executed per chunk decision; 0: the start checkpoint's own
    num_envs: PositiveInt = 2  # parallel envs (processes on physx_cpu)
    max_episode_steps: PositiveInt = 100  # the time limit (a truncation: bootstrapped, not terminal)
    backend: str = "auto"  # "auto", "physx_cpu" or "physx_cuda"
    reward: str = "sparse"  # "sparse": 1 on success (terminal); "dense": normalized_dense; "shaped": sparse + potential
    terminate_on_success: bool = True  # "sparse": a success ends learning's episode; false: it runs on, 1 per solved
                                       # step [toolkit: no_termination]
    reward_scale: PositiveFloat = 1.0  # learning sees reward_scale * r (value targets of O(1)); logged returns are raw
    success_bonus: NonNegativeFloat = 0.0  # reward "dense": added per solved step (learning only)
    num_inference_steps: PositiveInt = 8  # K, the denoising steps of the flow (noisy chain or frozen ODE)
    min_noise_std: PositiveFloat = 0.01  # lower bound of the exploration std (of whatever the method draws)
    max_noise_std: PositiveFloat = 0.3  # upper bound of the exploration std at the start; decays to final_noise_std
    final_noise_std: PositiveFloat = 0.01  # that bound at the end of noise_decay_steps
    noise_schedule: str = "linear"  # how the bound decays: "constant", "linear" or "exp"
    noise_decay_steps: NonNegativeInt = 512  # env steps over which it decays
    total_env_steps: PositiveInt = 512  # the run's budget
    rollout_steps: PositiveInt = 8  # decisions per env per iteration (chunks; a per-step residual: chunks of steps)
    gamma: Fraction = 0.99  # discount per env step
    actor_lr: NonNegativeFloat = 3e-5  # the policy's learning rate (0: the policy stays as it starts, a control)
    critic_lr: PositiveFloat = 1e-4  # the value / Q nets' learning rate
    lr_schedule: str = "constant"  # both learning rates over the run: "constant" or "cosine" (down to lr_min_ratio)
    lr_min_ratio: Fraction = 0.1  # "cosine": the rates end at this share of actor_lr and critic_lr
    max_grad_norm: PositiveFloat = 1.0  # gradient-norm clip of every update [toolkit: grad_clip_0.5, grad_clip_off]
    obs_clip: NonNegativeFloat = 5.0  # normalised observations clipped to +-obs_clip (0: off)
    critic_warmup_steps: NonNegativeInt = 128  # iterations that start within these env steps update only the critic
    value_hidden_dims: list[PositiveInt] = dataclasses.field(default_factory=lambda: [256, 256])  # V / Q hidden sizes
    warm_start_value: bool = True  # V from a stage-2 checkpoint's critic (same inputs), when there is one
    eval_every: NonNegativeInt = 0  # iterations between validations (pick best_model.pt); 0: only before and after
    num_eval_episodes: PositiveInt = 4  # episodes per evaluation
    val_seed: NonNegativeInt = 10_000  # env seeds of the validations
    eval_seed: NonNegativeInt = 20_000  # env seeds of the before / after report (never used to pick a model)
    train_seed: NonNegativeInt = 2_000_000  # env seeds of training episodes start here
    ckpt_every: PositiveInt = 1  # iterations between last.pt checkpoints
    bench_num_envs: list[PositiveInt] = dataclasses.field(default_factory=lambda: [1, 2])  # throughput table
    bench_decisions: PositiveInt = 8  # chunk decisions per throughput measurement
    num_threads: NonNegativeInt = 1  # torch threads (0: torch's default)
    resume: bool = True  # go on from the run folder's last.pt when there is one
    run_name: str = "default"  # the run folder, outputs/<notebook>/<run_name>
    wandb_mode: str = "disabled"  # "disabled", "offline" or "online"

    def run_checks(self) -> list[tuple[bool, str]]:
        return [
            (self.reward in REWARDS, f"reward must be one of {REWARDS}, got {self.reward!r}"),
            (self.success_bonus == 0 or self.reward == "dense",
             f"success_bonus ({self.success_bonus}) applies to reward 'dense' only (got reward {self.reward!r}): "
             f"the sparse and shaped rewards already pay a success alone; set success_bonus: 0.0 or reward: dense"),
            *self.shaping_checks(),
            (self.terminate_on_success or self.reward == "sparse",
             f"terminate_on_success: false applies to reward 'sparse' (got {self.reward!r}): the dense reward never "
             f"ends an episode on success and the shaped one's potential assumes it does"),
            (self.noise_schedule in NOISE_SCHEDULES,
             f"noise_schedule must be one of {NOISE_SCHEDULES}, got {self.noise_schedule!r}"),
            (self.lr_schedule in LR_SCHEDULES, f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}"),
            (self.min_noise_std <= min(self.max_noise_std, self.final_noise_std),
             f"need min_noise_std ({self.min_noise_std}) <= final_noise_std ({self.final_noise_std}) and "
             f"max_noise_std ({self.max_noise_std})"),
            (self.gamma > 0, "gamma must be in (0, 1]"),
            (abs(self.val_seed - self.eval_seed) >= self.num_eval_episodes,
             f"val_seed ({self.val_seed}) and eval_seed ({self.eval_seed}) episodes overlap: the report would be "
             f"scored on episodes that picked best_model.pt; keep them >= num_eval_episodes apart"),
        ]


@dataclass
class ReplayConfig:
    """The replay of the off-policy learners (SAC over ``x_0``, TD3 on a per-step residual)."""

    replay_batch_size: PositiveInt = 256  # transitions per gradient step
    replay_updates_per_decision: PositiveFloat = 1.0  # gradient steps per stored decision (per env step for a
                                                      # per-step residual): the update-to-data ratio
    replay_size: PositiveInt = 200_000  # decisions kept (the oldest are dropped)
    target_tau: Fraction = 0.005  # Polyak rate of the target nets

    def replay_checks(self) -> list[tuple[bool, str]]:
        return [(self.replay_size >= self.replay_batch_size,
                 f"replay_size ({self.replay_size}) must hold at least one batch ({self.replay_batch_size})"),
                (self.target_tau > 0, f"target_tau must be in (0, 1], got {self.target_tau}")]


# --------------------------------------------------------------------------- checkpoints


def save_agent(path: Path, agent, actor_opt, critic_opt, cfg, iteration: int, runner: ChunkRunner, best: dict,
               **extra) -> Path:
    """The checkpoint (atomic): weights, optimisers, config, progress, RNG, and ``extra`` (a replay buffer)."""
    return save_torch({"format": CHECKPOINT_FORMAT, "meta": agent.meta, "config": dataclasses.asdict(cfg),
                       "agent": agent.state_dict(), "actor_opt": actor_opt.state_dict(),
                       "critic_opt": critic_opt.state_dict(), "iteration": iteration, "env_steps": runner.env_steps,
                       "next_seed": runner.next_seed, "best": best, **rng_state(), **extra}, path)


def read_agent_checkpoint(path: str | Path) -> dict:
    """A stage-3 checkpoint's dict (its policy meta completed), or a clear error for any other file."""
    ckpt = load_torch(path, "train one with notebook 03 or 06 (python -m flowlib.run 03_reinflow)")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        kind = f" (it is a {ckpt['format']} file)" if isinstance(ckpt, dict) and "format" in ckpt else ""
        raise ValueError(f"{path} is not a stage-3 checkpoint (format {CHECKPOINT_FORMAT}){kind}: pass a last.pt or "
                         f"best_model.pt of notebook 03 / 06")
    return {**ckpt, "meta": chunk_policy.complete_meta(ckpt["meta"])}


# --------------------------------------------------------------------------- the pieces of an iteration


def learning_runner(cfg: RunConfig, env, obs_horizon: int, first_seed: int) -> ChunkRunner:
    """The ``ChunkRunner`` that pays ``cfg``'s learning reward (its kind, scale, bonus and PickCube's reach, grasp
    and place terms), with episodes from ``first_seed`` on: what a run trains on, and what a benchmark of its
    checkpoint must score with."""
    return ChunkRunner(env, obs_horizon, cfg.gamma, cfg.reward, first_seed=first_seed,
                       reward_scale=cfg.reward_scale, success_bonus=cfg.success_bonus,
                       reach_weight=cfg.reach_weight, grasp_min_gap=cfg.grasp_min_gap,
                       place_weight=cfg.place_weight, place_sharpness=cfg.place_sharpness,
                       reach_sharpness=cfg.reach_sharpness, terminate_on_success=cfg.terminate_on_success)


def in_critic_warmup(steps_before: int, cfg: RunConfig) -> bool:
    """Whether the iteration that starts after ``steps_before`` env steps updates only the critic.

    It does if it starts within the first ``critic_warmup_steps`` env steps: ceil(N / steps per iteration)
    iterations, so the policy learns from none of the first N env steps (an iteration that only *ended*
    by step N would round down, and N below one iteration would mean no warm-up at all)."""
    return steps_before < cfg.critic_warmup_steps


def episode_stats(episodes: list[dict]) -> dict[str, float]:
    """The ``train/...`` means of a log row over the episodes that ended (``ChunkRunner.pop_finished``)."""
    if not episodes:
        return {}
    return {"train/success_once": float(np.mean([e["success_once"] for e in episodes])),
            "train/success_at_end": float(np.mean([e["success_at_end"] for e in episodes])),
            "train/return": float(np.mean([e["return"] for e in episodes])),
            "train/episode_length": float(np.mean([e["length"] for e in episodes])),
            **{f"train/{k}": float(np.mean([e[k] for e in episodes])) for k in episodes[0]
               if k.endswith("_once") and k != "success_once"}}


def validate(agent, env, cfg: RunConfig, runner: ChunkRunner, row: dict) -> float:
    """The periodic evaluation of the deterministic policy on the ``val_seed`` episodes (they pick
    ``best_model.pt``): adds ``eval/...`` to ``row``, restarts the training episodes, returns success_once."""
    result = bc.evaluate(agent, env, cfg.num_eval_episodes, cfg.num_inference_steps, seed=cfg.val_seed)
    runner.restart()
    row.update({"eval/success_once": result["success_once"], "eval/success_at_end": result["success_at_end"],
                "eval/return": result["return"],
                **{f"eval/{name}_once": rate for name, rate in result["flags_once"].items()}})
    return result["success_once"]


def prepare_run(cfg: RunConfig, agent, run_path: Path) -> Path:
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


def resume(cfg, agent, last: Path, learner, env, tracker=None):
    """``(iteration, runner, best)`` to go on from: ``last`` when ``cfg.resume`` and it exists (agent, optimisers,
    the learner's own state, RNG, env seeds and the tracker rewound to it), else a fresh start."""
    start, next_seed, env_steps, best = 0, cfg.train_seed, 0, {"success_once": -1.0, "env_steps": 0}
    if cfg.resume and last.exists():
        ckpt = read_agent_checkpoint(last)
        if ckpt["meta"] != agent.meta:
            raise ValueError(f"{last} belongs to another policy; use another run_name or resume=False")
        was = {k: ckpt["config"].get(k, default) for k, default in (("steer", "chain"), ("learner", "ppo"))}
        if was != {"steer": cfg.steer, "learner": cfg.learner}:
            raise ValueError(f"{last} is a run with {was}, this one has steer {cfg.steer!r} and learner "
                             f"{cfg.learner!r}: use another run_name or resume=False")
        agent.load_state_dict(ckpt["agent"])
        learner.actor_opt.load_state_dict(ckpt["actor_opt"])
        learner.critic_opt.load_state_dict(ckpt["critic_opt"])
        learner.load_state(ckpt, last)
        set_rng_state(ckpt)
        start, next_seed, env_steps, best = ckpt["iteration"], ckpt["next_seed"], ckpt["env_steps"], ckpt["best"]
        if tracker is not None:
            tracker.rewind(env_steps)
        print(f"resumed from {last} at iteration {start} ({env_steps} env steps)")
    runner = learning_runner(cfg, env, agent.obs_horizon, next_seed)
    runner.env_steps = env_steps
    return start, runner, best


def end_iteration(cfg: RunConfig, agent, env, runner: ChunkRunner, row: dict, best: dict, iteration: int,
                  num_iters: int, run_path: Path, learner, tracker=None) -> dict:
    """What ends an iteration after its update: every ``eval_every`` iterations the validation (``best_model.pt``
    when it beats ``best``), the log row, and every ``ckpt_every`` iterations ``last.pt``, with the learner's own
    state in it (a replay buffer).  Returns ``best``, updated."""
    opts = (learner.actor_opt, learner.critic_opt)
    if cfg.eval_every and (iteration + 1) % cfg.eval_every == 0 and iteration + 1 < num_iters:
        success = validate(agent, env, cfg, runner, row)
        if success > best["success_once"]:
            best = {"success_once": success, "env_steps": runner.env_steps}
            save_agent(run_path / "best_model.pt", agent, *opts, cfg, iteration + 1, runner, best)
    if tracker is not None:
        tracker.log(row, runner.env_steps)
    if (iteration + 1) % cfg.ckpt_every == 0 or iteration + 1 == num_iters:
        save_agent(run_path / "last.pt", agent, *opts, cfg, iteration + 1, runner, best, **learner.state())
    return best


# --------------------------------------------------------------------------- the loop


def train(cfg: RunConfig, agent, learner, env, run_path: Path, tracker=None) -> dict:
    """The stage-3 loop (module docstring) for ``agent`` and its ``learner`` (``flowlib.rl.learners``).

    Each iteration sets the exploration std from the schedule, collects ``learner.env_steps_per_iteration`` env
    steps, then updates (the critic alone in iterations that start before ``critic_warmup_steps``).  Every
    ``eval_every`` iterations the deterministic policy is evaluated on ``val_seed`` episodes, which pick
    ``best_model.pt`` (the training episodes restart afterwards); ``eval_seed`` stays for the report.
    ``last.pt`` (atomic) every ``ckpt_every`` iterations; with ``resume`` a run continues from it.
    Returns ``{"best": ..., "iterations": ..., "env_steps": ..., "train_time_s": ...}``, the training time counting
    a resumed run's earlier sessions (from the tracker's rows)."""
    t_start = time.time()
    run_path = prepare_run(cfg, agent, run_path)
    learner.build_optimizers()
    per_iter = learner.env_steps_per_iteration(env.num_envs)
    num_iters = max(1, math.ceil(cfg.total_env_steps / per_iter))
    start, runner, best = resume(cfg, agent, run_path / "last.pt", learner, env, tracker)
    trained_before = tracker.rows[-1]["wall_time"] if tracker is not None and tracker.rows else 0.0
    learner.start(runner, torch.Generator().manual_seed(cfg.seed * 100_003 + start))
    bar = progress.bar(num_iters, learner.name, initial=start, unit="iteration")
    for iteration in range(start, num_iters):
        max_std = noise_schedule(cfg.noise_schedule, runner.env_steps / max(cfg.noise_decay_steps, 1),
                                 cfg.max_noise_std, cfg.final_noise_std)
        agent.set_max_noise_std(max_std)
        lr_scale = lr_factor(cfg.lr_schedule, iteration / num_iters, cfg.lr_min_ratio)
        for opt in (learner.actor_opt, learner.critic_opt):
            for group in opt.param_groups:  # each group scaled from the rate it was built with (kept in last.pt)
                group.setdefault("base_lr", group["lr"])
                group["lr"] = group["base_lr"] * lr_scale
        agent.eval()
        t0 = time.time()
        steps_before, data, policy_time = learner.collect()
        rollout_time = time.time() - t0
        warmup = in_critic_warmup(steps_before, cfg)
        agent.train()
        t1 = time.time()
        stats = learner.update(data, train_policy=not warmup)
        update_time = time.time() - t1
        episodes = runner.pop_finished()
        row = {"iteration": iteration + 1, "max_noise_std": max_std, "lr_scale": lr_scale, "critic_warmup": float(warmup),
               "episodes": len(episodes), "rollout_time": rollout_time, "rollout_policy_time": policy_time,
               "update_time": update_time, "env_steps_per_s": per_iter / max(rollout_time, 1e-9), **stats,
               **episode_stats(episodes)}
        best = end_iteration(cfg, agent, env, runner, row, best, iteration, num_iters, run_path, learner, tracker)
        bar.update()
    bar.close()
    agent.eval()
    return {"best": best, "iterations": num_iters, "env_steps": runner.env_steps,
            "train_time_s": trained_before + time.time() - t_start}


def on_all_cores(step, n: int) -> list:
    """``[step(i) for i in range(n)]`` with every core given to torch: the env workers wait while the nets learn."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return [step(i) for i in range(n)]
    finally:
        torch.set_num_threads(threads)
