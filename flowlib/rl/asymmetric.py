"""Asymmetric critics (Pinto et al. 2018, Sec. IV): the actor reads what it will have when deployed (a camera's
embedding), the critic reads what training has at hand, the simulator's state.

A critic is needed only during training, where ManiSkill gives its state observation beside the camera's
(``flowlib.envs.maniskill.ManiSkillVecEnv.privileged``, ``EnvSpec.state_dim`` wide); the object's pose, which a frozen visual
encoder may hold only roughly, is what a value depends on most.  Two critics read it when ``asymmetric_critic`` is
set: residual TD3's twin ``Q(c, r)`` and per-step residual PPO's ``V(c)``, ``c`` = (state, base action)
(``flowlib.methods.residual_step``), and chain PPO's ``V(state)`` (``flowlib.methods.reinflow``): every method that runs on a visual
policy (``flowlib.methods.stage3.VISUAL_METHODS``).

The state is normalised by its own mean and std, fitted once on the first transitions the critic sees (the first
iteration's: a replay's for TD3, a rollout's for PPO) and kept in the checkpoint, like the policy's observation
normaliser is fitted once on the demonstrations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AsymmetricConfig:
    """Whether the critic reads the simulator's state (read by the visual methods: ``chain/ppo``, ``residual_step``)."""

    asymmetric_critic: bool = False  # the critics read ManiSkill's state, the actor the camera (a visual policy only)

    def asymmetric_checks(self) -> list[tuple[bool, str]]:
        if not self.asymmetric_critic:
            return []
        return [(getattr(self, "critic_input", "obs") == "obs", "asymmetric_critic gives V the simulator's state in "
                 f"place of the observation: critic_input must be 'obs', got {getattr(self, 'critic_input', None)!r}"),
                (getattr(self, "branches", 1) == 1, "asymmetric_critic keeps one simulator state per decision; branches "
                 f"({getattr(self, 'branches', 1)}) try several from one: use branches: 1")]


def asymmetric_problem(cfg, meta: dict) -> str:
    """Why ``cfg.asymmetric_critic`` cannot run on a start policy of ``meta``, or ""."""
    if cfg.asymmetric_critic and meta.get("obs_mode", "state") == "state":
        return ("asymmetric_critic gives the critics the simulator's state while the actor reads a camera; this start "
                "policy reads the state already (its critics do too): set asymmetric_critic: false")
    return ""


def privileged_width(cfg, meta: dict, state_dim: int) -> int:
    """``P``, the state width an agent's critic reads: ``state_dim`` (``EnvSpec.state_dim``) with
    ``cfg.asymmetric_critic``, else 0 (also for a method whose options have no ``AsymmetricConfig``: chain/rfc builds
    the chain's agent); refuses a state start and a missing width by name."""
    if not getattr(cfg, "asymmetric_critic", False):
        return 0
    if asymmetric_problem(cfg, meta):
        raise ValueError(asymmetric_problem(cfg, meta))
    if state_dim <= 0:
        raise ValueError("asymmetric_critic needs the width of the env's state observation (EnvSpec.state_dim): build "
                         "the agent with the env's spec (stage3.build_agent(cfg, path, env.spec))")
    return int(state_dim)


class CriticStateNorm:
    """Mixin of an agent (an ``nn.Module``) whose critic may read the simulator's state ``[B, P]``: the buffers
    ``critic_obs_mean`` / ``critic_obs_std`` / ``critic_obs_fitted`` (in the checkpoint; ``stage3`` reads ``P`` back
    from the mean's length), ``fit_critic_normalizer`` and ``critic_obs``."""

    privileged_dim: int = 0

    def _init_critic_state(self, privileged_dim: int) -> None:
        self.privileged_dim = int(privileged_dim)
        if self.privileged_dim:
            self.register_buffer("critic_obs_mean", torch.zeros(self.privileged_dim))
            self.register_buffer("critic_obs_std", torch.ones(self.privileged_dim))
            self.register_buffer("critic_obs_fitted", torch.tensor(False))

    @property
    def critic_state_fitted(self) -> bool:
        return not self.privileged_dim or bool(self.critic_obs_fitted)

    @torch.no_grad()
    def fit_critic_normalizer(self, privileged: torch.Tensor, min_std: float = 1e-2) -> None:
        """Fix the critic's state normaliser to the mean and std (at least ``min_std``) of ``privileged [M, P]``."""
        if privileged.shape[-1] != self.privileged_dim or len(privileged) < 2:
            raise ValueError(f"fitting the critic's state normaliser needs >= 2 states of {self.privileged_dim} dims, "
                             f"got {tuple(privileged.shape)}")
        privileged = privileged.to(self.critic_obs_mean.device).float()
        self.critic_obs_mean.copy_(privileged.mean(0))
        self.critic_obs_std.copy_(privileged.std(0).clamp(min=min_std))
        self.critic_obs_fitted.fill_(True)

    def critic_obs(self, privileged: torch.Tensor | None, clip: float = 0.0) -> torch.Tensor:
        """The normalised state ``[B, P]`` (clipped to ``+-clip`` when > 0) that the critic reads."""
        if privileged is None or privileged.shape[-1] != self.privileged_dim:
            got = None if privileged is None else tuple(privileged.shape)
            raise ValueError(f"this agent's critic reads the simulator's state ({self.privileged_dim} dims; "
                             f"asymmetric_critic), got {got}: pass the env's privileged state beside the observation")
        if not bool(self.critic_obs_fitted):
            raise RuntimeError("the asymmetric critic's state normaliser is not fitted: call fit_critic_normalizer on "
                               "the first transitions before the first critic step")
        z = (privileged - self.critic_obs_mean) / self.critic_obs_std
        return z.clamp(-clip, clip) if clip > 0 else z
