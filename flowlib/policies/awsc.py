"""Stage 2: AW-ShortCut Flow, offline RL by advantage-weighted ShortCut BC.

Recipe (notebook 02):

1. Data with contrast: the motion-planned demos plus rollouts of the stage-1 policy in the
   simulator, with and without exploration noise (``collect_rollouts``; cached under
   ``outputs/data/<env>/`` in ManiSkill's trajectory format).  For the critic every episode is cut after
   its first success, which is terminal (``flowlib.policies.critic.truncate_at_success``); the flow trains on the
   episodes as recorded (``flow_episodes="uncut"``), each window after a success weighted as the decision
   at the success step (``flowlib.policies.critic.cut_window_index``).  Cutting the flow's episodes too
   (``"cut"``, the runs recorded before 2026-12-05) teaches it to stop at the edge of success: on PushCube
   that alone cost ~0.1 success (docs/results/tasks.md).
2. A chunk-level critic on the SMDP transitions of that data (``flowlib.policies.critic``: IQL by default,
   Monte Carlo for comparison), trained on a split of the episodes; held-out episodes measure it.
3. AWR weights ``w = min(exp(beta A), w_max)`` per (observation window, action chunk) and the
   stage-1 policy fine-tuned with the weighted ShortCut loss (``flowlib.policies.bc.train`` with ``weights``;
   ``train_weighted``: one run per training seed).
4. The same data through two other offline methods, as baselines: RFC's masks as 0/1 weights on the same
   loss (``flowlib.policies.critic.rfc_mask``, ``mask_weights``) and FQL's offline phase (``flowlib.methods.fql.train_offline``).

**RFC after steering** (the RLinf notes pair reflow with DSRL): ``rollout_checkpoint`` names a stage-3 checkpoint,
e.g. DSRL's policy over ``x_0`` (``flowlib.methods.latent``) or a per-step residual (``flowlib.methods.residual_step``), whose
deterministic policy collects the rollouts in place of stage 1's.  Steering leaves the flow's weights as they were;
reflowing the flow on the steered episodes (RFC ``success_only``: the demos and the steered episodes that succeed)
distils what the steering found into the flow itself, which then acts from ``x_0 ~ N(0, I)`` with no head and no
residual net.  The flow trained is still the ``stage1_checkpoint``'s.

The weight multiplies the whole per-sample ShortCut loss: the flow-matching term at ``d_min`` and
the self-consistency term alike.  The weighted objective is then the ShortCut loss under the
re-weighted data distribution ``pi*(a|s) ~ pi_data(a|s) exp(beta A(s, a))`` (AWR, Peng et al. 2019,
Eq. 7), and both terms must describe that same distribution: weighting only the flow term would
leave the large-step shortcuts distilling a mixture of the old and new flows, so 1-step and 8-step
sampling would drift apart.

Checkpoints are stage-1 checkpoints (``flowlib.policies.bc``) with format ``flowlib.aw_shortcut/1`` and the
critic added; ``load_from_aw_shortcut_flow`` returns both for stage 3.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowlib.envs.data import Episode, demo_dir, load_demos, save_episodes
from flowlib.infra import config
from flowlib.infra.config import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    check_fields,
    require,
)
from flowlib.infra.runs import checkpoint_location, load_torch, policy_checkpoint
from flowlib.infra.tracking import Tracker
from flowlib.policies import bc, chunk_policy
from flowlib.policies.critic import RFC_MASKS, ChunkCritic, ChunkTransitions, critic_from_state

ROLLOUT_SEED = 1_000_000  # env seeds of the stage-1 rollouts start here (demos from 0, evaluations 10_000+)


@dataclass
class AWShortCutConfig:
    """Parameters of notebook 02 (AW-ShortCut). Defaults are the small CPU run: FastReach, from notebook 01's default
    clone, its 1,000 demos and 400 of its rollouts, every stage-2 method scored on 500 held-out episodes paired with
    stage 1 (a minute or two on 2 cores); the ManiSkill and Meta-World runs are ``params/02_aw_shortcut/*.yaml``."""

    seed: NonNegativeInt = 0
    stage1_checkpoint: str = ""         # relative to outputs/; "" means 01_shortcut_bc/default/best_model.pt
    env_id: str = "FastReach-v0"
    num_demos: PositiveInt = 1000
    demo_file: str = ""  # an existing ManiSkill .h5 (state, pd_ee_delta_pos); "" means generate
    # data with contrast: stage-1 rollouts per exploration-noise level (std of N(0, s^2) on actions in [-1, 1])
    rollout_episodes: PositiveInt = 200  # stage-1 rollouts per noise level, added to the demos
    rollout_noise_stds: list[NonNegativeFloat] = field(default_factory=lambda: [0.0, 0.1])  # action-noise std of each rollout batch (actions lie in [-1, 1])
    rollout_inference_steps: PositiveInt = 4  # K of the stage-1 policy during the rollouts
    rollout_checkpoint: str = ""  # a checkpoint whose policy collects the rollouts in place of stage 1's, e.g. a steering run's last.pt: RFC after steering (empty: stage 1)
    # critic
    critic: str = "iql"                 # "iql" or "mc"
    reward: str = "sparse"              # "sparse" (success) or "dense" (normalized_dense)
    gamma: Fraction = 0.99  # discount per env step
    expectile: Fraction = 0.7  # IQL's expectile tau for V (0.5 is the mean)
    target_polyak: Fraction = 0.005  # rate of the target critic's soft update
    critic_hidden_dims: list[PositiveInt] = field(default_factory=lambda: [256, 256])  # hidden widths of the Q and V nets
    critic_lr: PositiveFloat = 3e-4  # the critic's learning rate
    critic_steps: PositiveInt = 1000  # critic gradient steps
    critic_batch_size: PositiveInt = 512  # transitions per critic step
    holdout_fraction: Fraction = 0.25  # share of episodes held out to score the critic
    # advantage weights
    beta: PositiveFloat = 10.0  # inverse temperature of the weights exp(beta A)
    max_weight: PositiveFloat = 20.0  # weights clipped at this value
    weighting: str = "exp"              # "exp" (clipped) or "softmax" (per batch of the whole dataset)
    # the same data, other offline methods: RFC's masks (filtered BC) and FQL (a one-step policy against Q)
    rfc_masks: list[str] = field(default_factory=lambda: list(RFC_MASKS))  # one RFC run per mask and training seed ([]: none)
    rfc_topk: Fraction = 0.25  # advantage_topk: the share of windows kept
    fql_offline_steps: NonNegativeInt = 500  # FQL's offline updates on the same data, per training seed (0: no FQL row)
    fql_alpha: PositiveFloat = 10.0  # FQL's distillation weight against the normalised -Q
    fql_hidden_dims: list[PositiveInt] = field(default_factory=lambda: [256, 256, 256])  # FQL's one-step policy MLP
    # AW-ShortCut training (one run per training seed)
    start_net: str = "ema"  # the stage-1 weights training goes on from: "ema" (the policy stage 1 scored) or "raw" (its live net)
    flow_episodes: str = "uncut"  # the flow trains on episodes "uncut" (as recorded) or "cut" at the first success (as the critic)
    train_seeds: list[NonNegativeInt] = field(default_factory=lambda: [0])  # one AW-ShortCut training run per seed
    train_steps: PositiveInt = 500
    batch_size: PositiveInt = 512
    lr: PositiveFloat = 1e-4
    weight_decay: NonNegativeFloat = 1e-6
    warmup_steps: NonNegativeInt = 50
    ckpt_every: PositiveInt = 250
    keep_every: NonNegativeInt = 0      # also keep step_<N>.pt every keep_every steps (0: none)
    log_every: PositiveInt = 25
    eval_every: NonNegativeInt = 0  # evaluate every this many steps (0 means only at the end)
    select_inference_steps: PositiveInt = 4  # K whose success_once picks best_model.pt
    eval_inference_steps: list[PositiveInt] = field(default_factory=lambda: [4])
    num_eval_episodes: PositiveInt = 500
    val_seed: NonNegativeInt = 10_000   # periodic evaluations (best_model.pt); as in notebook 01
    eval_seed: NonNegativeInt = 20_000  # the stage-1 vs stage-2 comparison; held out from demos and rollouts
    num_envs: PositiveInt = 500
    max_episode_steps: PositiveInt = 40
    backend: str = "auto"
    num_threads: NonNegativeInt = 1
    resume: bool = True
    run_name: str = "default"
    wandb_mode: str = "disabled"

    def __post_init__(self):
        check_fields(self)
        require([
            (self.critic in ("iql", "mc"), f"critic must be 'iql' or 'mc', got {self.critic!r}"),
            (self.reward in ("sparse", "dense"), f"reward must be 'sparse' or 'dense', got {self.reward!r}"),
            (self.weighting in ("exp", "softmax"), f"weighting must be 'exp' or 'softmax', got {self.weighting!r}"),
            (self.start_net in ("ema", "raw"), f"start_net must be 'ema' or 'raw', got {self.start_net!r}"),
            (self.flow_episodes in ("uncut", "cut"), f"flow_episodes must be 'uncut' or 'cut', got {self.flow_episodes!r}"),
            (0 < self.expectile < 1, f"expectile must be in (0, 1), got {self.expectile}"),
            (self.gamma > 0, f"gamma must be in (0, 1], got {self.gamma}"),
            (self.holdout_fraction < 1, f"holdout_fraction must be in [0, 1), got {self.holdout_fraction}"),
            (len(self.train_seeds) > 0, "train_seeds must list at least one seed"),
            (self.rollout_episodes <= 100_000, "rollout_episodes must be <= 100000 (seed blocks of 100000)"),
            (set(self.rfc_masks) <= set(RFC_MASKS), f"rfc_masks must be a list of {RFC_MASKS}, got {self.rfc_masks}"),
            (self.rfc_topk > 0, f"rfc_topk must be in (0, 1], got {self.rfc_topk}"),
        ])


def stage1_checkpoint_path(cfg: AWShortCutConfig) -> Path:
    return policy_checkpoint(cfg.stage1_checkpoint, "stage1_checkpoint")


def rollout_checkpoint_path(cfg: AWShortCutConfig) -> Path | None:
    """The checkpoint whose deterministic policy collects the rollouts (``rollout_checkpoint``: any checkpoint
    ``flowlib.tools.evaluate`` reads, a stage-3 steering run's ``last.pt`` above all), or None for stage 1's own."""
    if not cfg.rollout_checkpoint:
        return None
    path = checkpoint_location(cfg.rollout_checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"rollout_checkpoint: checkpoint {path} not found: run the steering it names first "
                                "(e.g. python -m flowlib.run 06_steering --params ...) or set rollout_checkpoint: '' "
                                "for stage 1's own rollouts")
    return path


ROLLOUT_META_KEYS = ("env_id", "control_mode", "obs_mode", "obs_dim", "action_dim")  # what must match stage 1's


def rollout_meta_problem(meta: Any, expected: dict[str, Any], path: Path) -> str:
    """Why the policy of ``meta`` (read from ``path``) cannot collect rollouts for a stage 1 of ``expected`` meta (""
    if it can): its episodes must be of the same task, control mode and observation, in the same dims."""
    if not isinstance(meta, dict) or "env_id" not in meta:
        return (f"rollout_checkpoint: {path} is not a flowlib policy checkpoint (no policy meta): pass a stage-3 "
                "last.pt / best_model.pt or a stage-1/2 best_model.pt")
    for key in ROLLOUT_META_KEYS:
        if key in expected and meta.get(key) != expected[key]:
            return (f"rollout_checkpoint: {path} has {key} = {meta.get(key)!r} but this stage 2 needs "
                    f"{expected[key]!r} (stage 1's): point rollout_checkpoint at a run that fine-tuned a policy of "
                    "the same task, control mode and observation")
    return ""


def check_rollout_policy(meta: Any, stage1_meta: dict[str, Any], path: Path) -> None:
    """``ValueError`` with ``rollout_meta_problem``'s message when the policy read from ``path`` cannot collect the
    rollouts for this stage 1."""
    problem = rollout_meta_problem(meta, stage1_meta, path)
    if problem:
        raise ValueError(problem)


def rollout_problem(cfg: AWShortCutConfig) -> str:
    """Why ``rollout_checkpoint`` cannot collect this run's rollouts ("" if it can or none is set): missing, not a
    policy checkpoint or of another task; checked before a run starts (``flowlib.tools.run.preflight``)."""
    try:
        path = rollout_checkpoint_path(cfg)
    except FileNotFoundError as err:
        return str(err)
    if path is None:
        return ""
    try:
        ckpt = load_torch(path, "")
    except ValueError as err:
        return f"rollout_checkpoint: {err}"
    return rollout_meta_problem(ckpt.get("meta") if isinstance(ckpt, dict) else None, {"env_id": cfg.env_id}, path)


def check_data_fits(meta: dict[str, Any], episodes: list[Episode], env_id: str) -> None:
    """The stage-1 policy, the data and the env must agree on task and dimensions."""
    if meta["env_id"] != env_id:
        raise ValueError(f"the stage-1 checkpoint was trained on {meta['env_id']}, this run is for {env_id}: "
                         f"set env_id={meta['env_id']!r} or point stage1_checkpoint at a {env_id} policy")
    obs_dim, action_dim = episodes[0].obs.shape[-1], episodes[0].actions.shape[-1]
    if (obs_dim, action_dim) != (meta["obs_dim"], meta["action_dim"]):
        raise ValueError(f"data has obs_dim={obs_dim}, action_dim={action_dim} but the stage-1 policy expects "
                         f"{meta['obs_dim']}, {meta['action_dim']}: use demos of the same env and control mode")


def _file_digest(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()[:10]


def collect_rollouts(policy: chunk_policy.FlowPolicy, env, cfg: AWShortCutConfig, stage1_path: Path) -> tuple[list[Episode], list[dict]]:
    """Rollouts of ``policy`` (stage 1's, or the ``rollout_checkpoint``'s, read from ``stage1_path``) at each
    exploration-noise level, cached per (checkpoint, settings).

    Noise level ``j`` uses env seeds ``ROLLOUT_SEED + 100_000 j + i`` (never the evaluation seeds).
    Returns the episodes (full length, as recorded: the actions executed, a per-step residual's corrections in
    them) and one summary row per noise level.
    """
    if policy.meta["obs_mode"] != "state":
        raise ValueError(f"{stage1_path} reads {policy.meta['obs_mode']} observations; stage 2's critic and its cached "
                         "rollouts read the state vector: start stage 2 from a state policy")
    episodes, rows = [], []
    for j, std in enumerate(cfg.rollout_noise_stds):
        seed = ROLLOUT_SEED + 100_000 * j
        tag = (f"rollouts_{_file_digest(stage1_path)}_K{cfg.rollout_inference_steps}_std{std:g}_seed{seed}"
               f"_n{cfg.rollout_episodes}_T{env.max_episode_steps}")
        path = demo_dir(cfg.env_id) / f"{tag}.state.{env.spec.control_mode}.h5"
        if path.exists():
            eps = load_demos(path)
        else:
            result = bc.evaluate(policy, env, cfg.rollout_episodes, cfg.rollout_inference_steps,
                                 seed=seed, action_noise_std=std, record=True)
            eps = result["rollouts"]
            save_episodes(path, eps, cfg.env_id, env.spec.control_mode, source=f"rollouts of {stage1_path}")
        episodes += eps
        rows.append({"noise_std": std, "episodes": len(eps), "success_once": float(np.mean([e.success.any() for e in eps])),
                     "file": path.name})
    return episodes, rows


def train_weighted(cfg: AWShortCutConfig, dataset, folder: Path, env, stage1_path: Path, weights: torch.Tensor,
                   extra: dict[str, Any], checkpoint_format: str = chunk_policy.AW_CHECKPOINT_FORMAT,
                   name: str = "") -> tuple[dict[int, chunk_policy.FlowPolicy], dict[int, list[dict]]]:
    """The weighted ShortCut loss (``bc.train`` with ``weights``: AW-ShortCut's ``exp(beta A)`` or an RFC mask's)
    from the stage-1 checkpoint, once per training seed, under ``folder/seed_<s>/`` (each resumes from its
    ``last.pt``).  Training goes on from the checkpoint's EMA weights (``start_net="ema"``), the policy stage 1 scored,
    or from its raw net (``"raw"``; the stage-2 runs recorded before 2026-12-05).  Returns the policies and the logged
    rows, by seed."""
    policies, rows = {}, {}
    for s in cfg.train_seeds:
        seed_cfg = dataclasses.replace(cfg, seed=s)
        seed_path = folder / f"seed_{s}"
        tracker = Tracker(seed_path, config.to_dict(seed_cfg), wandb_mode=cfg.wandb_mode, project="flowlib-02",
                          name="-".join(filter(None, [cfg.run_name, name, f"seed{s}"])), resume=cfg.resume)
        start = chunk_policy.load_policy(stage1_path)
        chunk_policy.require_flow(start.meta, stage1_path, "stage 2")  # its loss and RFC's reflow are the flow's
        if cfg.start_net == "ema":
            start.flow.adopt_ema()
        policies[s], _ = bc.train(seed_cfg, dataset, seed_path, tracker, env=env, policy=start,
                                  weights=weights, extra=extra, checkpoint_format=checkpoint_format)
        tracker.finish()
        rows[s] = tracker.rows
    return policies, rows


@torch.no_grad()
def advantages(critic: ChunkCritic, data: ChunkTransitions, batch_size: int = 4096) -> torch.Tensor:
    """``A(s, a_chunk)`` for every transition, in batches: ``[N]``."""
    out = []
    for i in range(0, len(data), batch_size):
        sl = slice(i, i + batch_size)
        out.append(critic.advantage(data.obs[sl], data.actions[sl], mc_return=data.mc_return[sl]))
    return torch.cat(out)


@torch.no_grad()
def values(critic: ChunkCritic, obs: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    return torch.cat([critic.value(obs[i:i + batch_size]) for i in range(0, len(obs), batch_size)])


def load_from_aw_shortcut_flow(path: str | Path, spec=None) -> tuple[chunk_policy.FlowPolicy, ChunkCritic | None]:
    """Stage-2 policy and its critic (``None`` for a stage-1 checkpoint), e.g. to start stage 3.

    With an env ``spec`` the policy is checked against it (env id, dims, control mode).
    """
    ckpt = chunk_policy.read_checkpoint(path)
    policy = chunk_policy.load_policy(path, spec)
    critic = critic_from_state(ckpt["critic"]) if "critic" in ckpt else None
    return policy, critic


def holdout_mask(sources: list[str], fraction: float, seed: int = 0) -> np.ndarray:
    """Boolean mask over episodes: ``fraction`` of each source (demos, each rollout kind) held out."""
    rng = np.random.default_rng(seed)
    sources = np.asarray(sources)
    mask = np.zeros(len(sources), dtype=bool)
    for src in np.unique(sources):
        idx = np.flatnonzero(sources == src)
        k = int(round(fraction * len(idx)))
        mask[rng.choice(idx, size=k, replace=False)] = True
    return mask
