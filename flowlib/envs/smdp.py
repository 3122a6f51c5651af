"""Action chunks as a semi-MDP: ``N`` vectorised envs stepped one chunk decision at a time.

A policy that plans a chunk of ``H`` actions and executes ``act_horizon = T_a`` of them makes one decision
every ``T_a`` env steps.  From the learner's side that decision is one transition of a semi-MDP (Sutton,
Precup and Singh 1999): it earns ``R = sum_{k<tau} gamma^k r_{t+k}`` over the ``tau <= T_a`` steps that ran and
bootstraps with ``gamma^tau``; ``tau < T_a`` when the episode ends inside the chunk.  A termination (success)
stops the bootstrap; a truncation (time limit) bootstraps from ``V`` of the last observation window.

``ChunkRunner`` is the env side of every stage-3 learner (``flowlib.methods.reinflow`` PPO through the chain,
``flowlib.methods.latent`` / ``flowlib.methods.latent_sac`` on ``x_0``, ``flowlib.methods.residual`` / ``flowlib.methods.residual_step``): it keeps
the observation windows, the per-episode bookkeeping and the reward the learner sees (sparse, dense, shaped,
and PickCube's reach / grasp / place terms), and knows nothing of the policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from flowlib.envs.tasks import PICKCUBE_FINGERS, PICKCUBE_OBJ_TO_GOAL, PICKCUBE_OBS_DIM, PICKCUBE_TCP_TO_OBJ, TASKS
from flowlib.infra.config import NonNegativeFloat, PositiveFloat

REWARDS = ("sparse", "dense", "shaped")
# the tasks whose reach / grasp-gap / place learning terms are written (flowlib.envs.tasks); PickCube's normalized dense
# reward is the reach term / 5 until the cube is grasped
REACH_ENVS = tuple(env_id for env_id, t in TASKS.items() if t.shaped_terms)


@dataclass
class ShapingConfig:
    """The learning terms a task's dense or shaped reward may add (``ChunkRunner``), written for ``REACH_ENVS``
    (PickCube) only: options of the task rather than of the run, each 0 (off) elsewhere (``shaping_checks``)."""

    reach_weight: NonNegativeFloat = 0.0  # PickCube, dense / shaped: weight of 1 - tanh(reach_sharpness |cube - tcp|)
    reach_sharpness: PositiveFloat = 5.0  # 1/m, of the reach term (ManiSkill's own is 5; 20 pays the last cm)
    grasp_min_gap: NonNegativeFloat = 0.0  # PickCube, dense / shaped: a grasp counts only with fingers at least this far apart (m)
    place_weight: NonNegativeFloat = 0.0  # PickCube, dense / shaped: weight of 1 - tanh(place_sharpness |goal - cube|)
    place_sharpness: PositiveFloat = 20.0  # 1/m, of the place term

    def shaping_checks(self) -> list[tuple[bool, str]]:
        """Each term needs reward "dense" or "shaped" (``self.reward``) and a task it is written for (``self.env_id``):
        the run config this class is a base of has both."""
        terms = (("reach_weight", "adds to the dense reward or the shaped reward's potential", "the reach term of the dense reward"),
                 ("grasp_min_gap", "gates the grasp in the dense reward", "the finger joints"),
                 ("place_weight", "adds to the dense reward or the shaped reward's potential", "the cube-to-goal offset"))
        return [check for name, what, reads in terms for check in (
            (getattr(self, name) == 0 or self.reward in ("dense", "shaped"),
             f"{name} ({getattr(self, name)}) {what} (got reward {self.reward!r}): set {name}: 0.0 or reward: dense / shaped"),
            (getattr(self, name) == 0 or self.env_id in REACH_ENVS,
             f"{name} reads {reads} of {REACH_ENVS} (got env_id {self.env_id!r}): set {name}: 0.0"))]


class Grasp(NamedTuple):
    """PickCube's grasp after a step, per env (``ChunkRunner._grasped``)."""
    flag: torch.Tensor   # [N] bool: the env's is_grasped
    held: torch.Tensor   # [N] bool: the flag with the fingers apart (>= grasp_min_gap)
    reach: torch.Tensor  # [N]: 1 - tanh(5 |cube - gripper|), the dense reward's own reach term
    to_cube: torch.Tensor  # [N]: |cube - gripper| (m)
    to_goal: torch.Tensor  # [N]: |goal - cube| (m)


class ChunkRunner:
    """Steps ``N`` envs one chunk decision at a time and keeps what persists across iterations:
    the observation windows ``[N, To, O]``, per-episode return / success / length, and the next
    episode seed.  Episodes end on termination (success, with ``reward="sparse"`` or ``"shaped"``) or at
    the time limit; an ended env is reset alone (``env.reset_some``) with the next training seed.  The
    decisions' rewards are scaled by ``reward_scale``; the episode returns it logs are not.

    Rewards per env step: ``"sparse"`` is 1 on success (which ends the episode); ``"dense"`` is the env's
    ``normalized_dense`` reward (ManiSkill's, with success worth 1 per step and no termination); ``"shaped"``
    is the sparse reward plus ``gamma * phi(s') - phi(s)`` with the potential ``phi`` = the normalized dense
    reward of the state reached (0 at the episode's start and at success): Ng et al. 1999, Thm. 1, so the
    policies that maximise it are those that maximise the sparse one, with the dense reward's guidance (while
    the critic learns: at its fixed point ``Q_shaped(s, a) = Q_sparse(s, a) - phi(s)``, the sparse reward's
    action-gradient; notebook 03).
    With ``terminate_on_success=False`` (``"sparse"`` only) a success does not end the episode: it runs to the time
    limit and earns 1 per solved step, so learning pays for holding the goal, not for touching it (ManiSkill's
    ``ignore_terminations``); every finished episode records ``success_at_end`` beside ``success_once``.
    The logged return of ``"shaped"`` is its sparse part (1 if the episode succeeded).  ``success_bonus``
    ``B`` (``"dense"`` only) adds ``B`` to what learning sees at every step whose state counts as solved, so a
    success is worth ``1 + B`` per step against a near-miss's 0.5-0.8; the logged return stays the env's.
    PickCube only: ``reach_weight`` ``w`` adds ``w (1 - tanh(k_r |cube - gripper|))`` (1 once grasped;
    ``k_r`` = ``reach_sharpness``, ManiSkill's 5/m by default) to the dense reward or to the shaped reward's
    potential; ``grasp_min_gap`` ``g`` counts the env's contact-based ``is_grasped`` only while the fingers are
    ``>= g`` apart, so a squeeze on the cube's edge earns what the approach earns, ``reach / 5`` (ManiSkill's reach),
    not the grasp's ``(reach + 1 + place) / 5`` (``_grasped``); ``place_weight`` ``w_p`` adds
    ``w_p (1 - tanh(k |goal - cube|))`` (``k`` = ``place_sharpness``) while the grasp counts (or at success), likewise:
    the dense reward's place term, ``(1 - tanh(5 d)) / 5``, pays ~0.01 per step for a centimetre, too little for the
    critic to tell a cube held 3 cm above the goal from one brought down into it (docs/stage3.md); at ``k = 20`` the
    last centimetres pay ~0.1-0.2 each.

    ``privileged [N, P]`` is the env's simulator state at the windows' last frame (``env.privileged``: ManiSkill's
    state observation, also under a camera), kept beside ``window`` and returned as ``next_privileged`` for an
    asymmetric critic (``flowlib.methods.residual_td3``); ``[N, 0]`` for an env without one (the fast tasks).
    """

    EPISODE_STATE = ("window", "privileged", "ep_return", "ep_success", "ep_success_now", "ep_flags", "ep_length",
                     "active", "phi")  # what ``save`` keeps

    def __init__(self, env, obs_horizon: int, gamma: float, reward: str = "sparse", first_seed: int = 2_000_000,
                 reward_scale: float = 1.0, success_bonus: float = 0.0, reach_weight: float = 0.0,
                 grasp_min_gap: float = 0.0, place_weight: float = 0.0, place_sharpness: float = 20.0,
                 reach_sharpness: float = 5.0, terminate_on_success: bool = True):
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        if not terminate_on_success and reward != "sparse":
            raise ValueError(f"terminate_on_success=False applies to reward 'sparse' (the dense reward never ends an "
                             f"episode on success, the shaped one's potential assumes it does), got {reward!r}")
        if success_bonus and reward != "dense":
            raise ValueError(f"success_bonus applies to reward 'dense' only, got reward {reward!r}")
        if reach_weight and reward == "sparse":
            raise ValueError(f"reach_weight applies to reward 'dense' or 'shaped', got reward {reward!r}")
        if grasp_min_gap and reward == "sparse":
            raise ValueError(f"grasp_min_gap applies to reward 'dense' or 'shaped', got reward {reward!r}")
        if place_weight and reward == "sparse":
            raise ValueError(f"place_weight applies to reward 'dense' or 'shaped', got reward {reward!r}")
        reads_state = [name for name, on in (("reward 'shaped'", reward == "shaped"), ("reach_weight", reach_weight),
                                             ("grasp_min_gap", grasp_min_gap), ("place_weight", place_weight)) if on]
        obs_mode = getattr(getattr(env, "spec", None), "obs_mode", "state")  # a bare test env may have no spec
        if reads_state and obs_mode != "state":
            raise ValueError(f"{', '.join(reads_state)} read the cube and the gripper from the state observation, and "
                             f"this env observes {obs_mode}: use reward 'dense' or 'sparse' without the "
                             "reach / grasp / place terms")
        self.env, self.obs_horizon, self.gamma, self.reward = env, obs_horizon, gamma, reward
        self.reward_scale, self.success_bonus, self.reach_weight = reward_scale, success_bonus, reach_weight
        self.grasp_min_gap, self.place_weight, self.place_sharpness = grasp_min_gap, place_weight, place_sharpness
        self.reach_sharpness, self.terminate_on_success = reach_sharpness, terminate_on_success
        N = env.num_envs
        self.next_seed = first_seed + N
        obs = env.reset(seed=first_seed).cpu()  # the rollout's bookkeeping is on the CPU, whatever the env's device
        self.window = obs[:, None].repeat(1, obs_horizon, 1)  # [N, To, O]
        self.privileged = self._privileged(N)                 # [N, P]
        self.ep_return = torch.zeros(N)
        self.ep_success = torch.zeros(N, dtype=torch.bool)
        self.ep_success_now = torch.zeros(N, dtype=torch.bool)  # success at the episode's latest step
        self.flag_names: list[str] = []  # the env's task flags (``env.task_flags``), known from the first step
        self.ep_flags = torch.zeros(N, 0, dtype=torch.bool)  # [N, F]: each flag true at some step of the episode
        self.ep_length = torch.zeros(N, dtype=torch.long)
        self.finished: list[dict] = []  # episodes ended since the last ``pop_finished``
        self.env_steps = 0  # simulator steps, summed over envs
        self.active = torch.ones(N, dtype=torch.bool)  # False: the episode ended and the env waits (no auto-reset)
        self.phi = torch.zeros(N)  # potential of the current state (reward "shaped")

    def restart(self, seeds: list[int] | None = None) -> None:
        """Reset every env, with fresh seeds or with ``seeds`` (one per env); episodes in flight are dropped."""
        N = self.env.num_envs
        if seeds is None:
            seeds, self.next_seed = list(range(self.next_seed, self.next_seed + N)), self.next_seed + N
        obs = self.env.reset(seed=list(seeds)).cpu()
        self.window = obs[:, None].repeat(1, self.obs_horizon, 1)
        self.privileged = self._privileged(N)
        self.ep_return.zero_(), self.ep_success.zero_(), self.ep_flags.zero_(), self.ep_length.zero_(), self.phi.zero_()
        self.ep_success_now.zero_()
        self.active.fill_(True)

    def step_chunk(self, actions: torch.Tensor, auto_reset: bool = True) -> dict[str, torch.Tensor]:
        """Execute ``actions [N, Ta, A]``; returns the SMDP pieces of this decision per env.

        ``reward`` = sum_{k<tau} gamma^k r, ``discount`` = gamma^tau, ``terminal``, ``end``, and
        ``next_window``: the window after the chunk (for an ended env: its last one, for bootstrapping), and
        ``next_privileged``, the simulator state at its last frame.
        Envs that ended are then reset (``auto_reset``), or else idle until ``restart``;
        ``self.window`` holds the windows of the next decision.
        """
        N, Ta = actions.shape[:2]
        reward, discount = torch.zeros(N), torch.ones(N)
        alive, terminal = self.active.clone(), torch.zeros(N, dtype=torch.bool)
        window, privileged = self.window.clone(), self.privileged.clone()
        for k in range(Ta):
            obs, r, term, trunc, success = (x.cpu() for x in self.env.step(actions[:, k].to(self.env.device)))
            r, term, extra = self._reward(obs, r, term, success, alive)
            reward += alive * discount * (r + extra) * self.reward_scale
            self.ep_return += alive * r
            self.ep_success |= alive & success
            self.ep_success_now = torch.where(alive, success, self.ep_success_now)
            self._track_flags(alive)
            self.ep_length += alive.long()
            discount = torch.where(alive, discount * self.gamma, discount)
            window = torch.where(alive[:, None, None], torch.cat([window[:, 1:], obs[:, None]], 1), window)
            privileged = torch.where(alive[:, None], self._privileged(N), privileged)
            ended = alive & (term | trunc)
            terminal |= alive & term
            alive &= ~ended
            self.env_steps += N  # simulator steps (an env that ended mid-chunk idles to the chunk's end)
        end = self.active & ~alive
        out = {"reward": reward, "discount": discount, "terminal": terminal, "end": end, "next_window": window,
               "next_privileged": privileged}
        self.window, self.privileged = window.clone(), privileged.clone()
        ended_rows = torch.nonzero(end).squeeze(1)  # one conversion per field: thousands of envs end together
        flag_keys = [f"{name}_once" for name in self.flag_names]
        for ret, success, at_end, length, flags in zip(
                self.ep_return[ended_rows].tolist(), self.ep_success[ended_rows].tolist(),
                self.ep_success_now[ended_rows].tolist(), self.ep_length[ended_rows].tolist(),
                self.ep_flags[ended_rows].tolist()):
            self.finished.append({"return": ret, "success_once": success, "success_at_end": at_end, "length": length,
                                  **dict(zip(flag_keys, flags))})
        if not auto_reset:
            self.active &= ~end
        elif end.any():
            seeds = [0] * N
            for i in torch.nonzero(end).squeeze(1).tolist():
                seeds[i], self.next_seed = self.next_seed, self.next_seed + 1
            obs = self.env.reset_some(end, seeds).cpu()
            self.window[end] = obs[end][:, None].repeat(1, self.obs_horizon, 1)
            self.privileged[end] = self._privileged(N)[end]
            self.ep_return[end], self.ep_success[end], self.ep_length[end], self.phi[end] = 0.0, False, 0, 0.0
            self.ep_success_now[end] = False
            self.ep_flags[end] = False
        return out

    def _privileged(self, N: int) -> torch.Tensor:
        """The env's simulator state now, ``[N, P]`` on the CPU (``[N, 0]``: the env has none)."""
        state = getattr(self.env, "privileged", None)
        return torch.zeros(N, 0) if state is None else state.cpu().float()

    def _track_flags(self, alive: torch.Tensor) -> None:
        """OR this step's task flags (``is_grasped``, ...) into the episodes still running."""
        flags = getattr(self.env, "task_flags", {})
        if list(flags) != self.flag_names or self.ep_flags.shape[1] != len(flags):  # the first step (also
            self.flag_names = list(flags)                                            # one rewound to)
            self.ep_flags = torch.zeros(self.env.num_envs, len(flags), dtype=torch.bool)
        if flags:
            self.ep_flags |= alive[:, None] & torch.stack([f.cpu() for f in flags.values()], 1)

    def _reward(self, obs: torch.Tensor, r: torch.Tensor, term: torch.Tensor, success: torch.Tensor,
                alive: torch.Tensor):
        """One env step's ``(task reward, termination, extra)`` per env under ``self.reward``; ``extra`` is
        what learning adds to the task reward and the logged return does not (shaping term, success bonus,
        reach and place terms, and the dense reward's grasp pay taken back from a grasp that ``_grasped`` does not
        hold)."""
        if self.reward == "sparse":  # 1 per solved step; a success ends the episode unless terminate_on_success is off
            return success.float(), success & self.terminate_on_success, torch.zeros_like(r)
        r_learn, grasped = r, None
        if self.reach_weight or self.grasp_min_gap or self.place_weight:
            grasped = self._grasped(obs)
            # a flag the gap does not count: the dense reward as before the grasp, reach / 5 (PickCube's dense reward
            # is (reach + is_grasped (1 + place) + is_obj_placed * static) / 5, and 1 at success)
            r_learn = torch.where(grasped.flag & ~grasped.held & ~success, grasped.reach / 5, r)
        terms = 0.0  # the reach and place terms
        if self.reach_weight:
            reach = 1 - torch.tanh(self.reach_sharpness * grasped.to_cube)
            terms = self.reach_weight * torch.where(grasped.held | success, 1.0, reach)
        if self.place_weight:
            place = 1 - torch.tanh(self.place_sharpness * grasped.to_goal)
            terms = terms + self.place_weight * torch.where(grasped.held | success, place, 0.0)
        if self.reward == "dense":
            return r, term, self.success_bonus * success.float() + terms + (r_learn - r)
        phi = torch.where(success, 0.0, r_learn + terms)  # the potential of the state reached; 0 once the episode ends
        shaping = self.gamma * phi - self.phi
        self.phi = torch.where(alive, phi, self.phi)
        return success.float(), success, shaping

    def _grasped(self, obs: torch.Tensor) -> Grasp:
        """PickCube's grasp after a step, per env: ``flag`` (the env's ``is_grasped``, read off contact forces: it
        also fires while the fingers squeeze an edge of the cube and slide off it), ``held`` (the flag with the
        fingers >= ``grasp_min_gap`` apart: across the cube's faces), ``reach = 1 - tanh(5 |cube - gripper|)``,
        ``to_cube = |cube - gripper|`` and ``to_goal = |goal - cube|`` from the observation ``obs [N, 42]``."""
        flags = getattr(self.env, "task_flags", {})
        if "is_grasped" not in flags:
            raise ValueError(f"reach_weight / grasp_min_gap / place_weight need the env's is_grasped flag "
                             f"(PickCube-v1's), got flags {list(flags)}: set them to 0.0")
        if obs.shape[-1] != PICKCUBE_OBS_DIM:
            raise ValueError(f"reach_weight / grasp_min_gap / place_weight read PickCube-v1's state observation "
                             f"({PICKCUBE_OBS_DIM} dims), got {obs.shape[-1]}: set them to 0.0")
        flag = flags["is_grasped"].cpu()
        held = flag & (obs[:, PICKCUBE_FINGERS].sum(1) >= self.grasp_min_gap)
        to_cube = obs[:, PICKCUBE_TCP_TO_OBJ].norm(dim=1)
        return Grasp(flag, held, 1 - torch.tanh(5 * to_cube), to_cube, obs[:, PICKCUBE_OBJ_TO_GOAL].norm(dim=1))

    def step_branches(self, actions: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Try ``M`` chunks ``actions [M, N, Ta, A]`` from the current state of every env: branch ``m < M-1``
        runs and is undone (``save`` / ``rewind``: simulator, step count and this runner's
        episode bookkeeping), and the last branch is the one the episode goes on with (``step_chunk``).
        Returns ``step_chunk``'s dict per branch; every branch's env steps count."""
        M = actions.shape[0]
        if M < 2:
            raise ValueError(f"step_branches needs >= 2 branches, got {M}")
        saved = self.save()
        outs = []
        for m in range(M - 1):
            outs.append(self.step_chunk(actions[m], auto_reset=False))
            self.rewind(saved)
        outs.append(self.step_chunk(actions[-1]))
        return outs

    def save(self) -> dict:
        """The present of every env, to ``rewind`` to: the simulator's state (``env.snapshot``, physx_cpu) and
        this runner's episode bookkeeping."""
        return {"env": self.env.snapshot(), "n_finished": len(self.finished),
                **{k: getattr(self, k).clone() for k in self.EPISODE_STATE}}

    def rewind(self, saved: dict) -> None:
        """Go back to ``saved`` (from ``save``): what ran since is undone, episodes it ended included."""
        self.env.restore(saved["env"])
        for k in self.EPISODE_STATE:
            setattr(self, k, saved[k].clone())
        del self.finished[saved["n_finished"]:]

    def pop_finished(self) -> list[dict]:
        done, self.finished = self.finished, []
        return done
