"""``FastAvoid-v0``: reach a goal past an obstacle that sits on the straight line, around either side.

The fast tasks of ``flowlib.envs.fast_envs`` have one good action per state, so a Gaussian clone's mean does as well
as a flow (issue 100).  Here the demonstrations have **two modes**: the obstacle sits exactly half way between the
start and the goal, both ways round are equally short, and the demonstrator picks a side per episode
(``DEMO_LEFT_SHARE`` of them on the left).  The mean of the two goes straight into the obstacle.

Planar and kinematic, in ``[-1, 1]^2``, as the other fast tasks: the agent is a point that moves by ``action *
MAX_STEP`` per step.  The start ``p_0`` lies on the left (x in [-0.8, -0.5]), the goal ``g`` on the right (x in [0.5,
0.8]), both with y in [-0.3, 0.3]; the obstacle is a disc of radius 0.25 at their midpoint ``o``.  A move into the
disc is stopped at its surface (the point keeps only the move's part along the surface) and **fails the episode**: a
collision, as with a real obstacle.  Success: ``|g - p| < 0.05`` with no collision so far.  obs ``[p, g, o, g - p,
o - p]`` (10).  Dense reward ``1 - tanh(3 |g - p|)``, 0 after a collision.  60 steps.

Evaluation flags (per step; ``flowlib.policies.policy_eval`` reports each as the share of episodes where it was ever
true): ``is_hit`` (the move touched the obstacle), ``is_left`` / ``is_right`` (the point is beside the obstacle on
that side of the start-to-goal line: within its radius along the line, outside it across), so an episode's mode is
the side it passed on.

The demonstrator goes to a waypoint beside the obstacle on its side (``DEMO_CLEARANCE`` past its surface), then to
the goal, at ``DEMO_SPEED`` of the largest step, with a per-episode heading error up to ``DEMO_HEADING_ERROR`` and
action noise ``DEMO_NOISE``.  Of 4,000 demos (seeds 0 on) 0.82 succeed: about a tenth collide (the heading error)
and the rest run out of time, which a faster, straighter policy would not; a straight line to the goal collides
in every episode.
"""
from __future__ import annotations

import torch

from flowlib.envs.fast_envs import MAX_STEP, FastVecEnv, _rotate

OBSTACLE_RADIUS = 0.25
DEMO_LEFT_SHARE = 0.5  # the share of demos that pass on the left
DEMO_SPEED = 0.55  # of MAX_STEP: the longer ways round run out of time
DEMO_CLEARANCE = 0.12  # the waypoint's distance from the obstacle's surface
DEMO_HEADING_ERROR = 0.3  # rad, the largest per-episode heading error: a tenth of the demos collide
DEMO_NOISE = 0.05  # std of the action noise


class FastAvoid(FastVecEnv):
    env_id, obs_dim, default_episode_steps, state_keys = "FastAvoid-v0", 10, 60, ("p", "g", "o", "h")
    SUCCESS_RADIUS = 0.05

    def _initial(self, generator):
        """The start on the left, the goal on the right, the obstacle half way; ``h[0]``: the episode has collided."""
        p = torch.stack([-0.8 + 0.3 * torch.rand((), generator=generator), -0.3 + 0.6 * torch.rand((), generator=generator)])
        g = torch.stack([0.5 + 0.3 * torch.rand((), generator=generator), -0.3 + 0.6 * torch.rand((), generator=generator)])
        return {"p": p, "g": g, "o": (p + g) / 2, "h": torch.zeros(2)}

    def _move(self, p_next):
        """A move that ends inside the obstacle stops on its surface, along the ray from its centre (the point slides
        round it, but the episode has failed)."""
        o = self.state["o"]
        offset = p_next - o
        dist = offset.norm(dim=-1, keepdim=True)
        inside = (dist < OBSTACLE_RADIUS).squeeze(-1)                                   # [N]
        surface = o + OBSTACLE_RADIUS * offset / dist.clamp(min=1e-6)
        self._hit = inside
        h = self.state["h"].clone()
        h[:, 0] = torch.maximum(h[:, 0], inside.float())
        return {"p": torch.where(inside[:, None], surface, p_next), "h": h}

    def axes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``u`` (obstacle -> goal) and its left normal ``n``, each ``[N, 2]``."""
        u = self.state["g"] - self.state["o"]
        u = u / u.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        return u, torch.stack([-u[:, 1], u[:, 0]], -1)

    def _evaluate(self):
        p, g, o = self.state["p"], self.state["g"], self.state["o"]
        clean = self.state["h"][:, 0] == 0
        dist = (g - p).norm(dim=-1)
        u, n = self.axes()
        along, across = ((p - o) * u).sum(-1), ((p - o) * n).sum(-1)
        beside = along.abs() < OBSTACLE_RADIUS
        flags = {"is_hit": self._hit.clone(), "is_left": beside & (across > 0), "is_right": beside & (across < 0)}
        return (dist < self.SUCCESS_RADIUS) & clean, (1 - torch.tanh(3 * dist)) * clean, flags

    def obs(self):
        p, g, o = self.state["p"], self.state["g"], self.state["o"]
        return torch.cat([p, g, o, g - p, o - p], -1)

    def _drawn(self):
        return [("g", 0.05, (60, 180, 75)), ("o", OBSTACLE_RADIUS, (120, 120, 120)), ("p", 0.04, (220, 50, 50))]

    def demonstrate(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """The demonstrator's actions ``[N, 2]`` (module docstring): round the obstacle on the episode's side."""
        p, g, o = self.state["p"], self.state["g"], self.state["o"]
        side = torch.where(self.demo_params[:, 1] < DEMO_LEFT_SHARE, 1.0, -1.0)[:, None]     # [N, 1]: +1 left
        u, n = self.axes()
        waypoint = o + side * (OBSTACLE_RADIUS + DEMO_CLEARANCE) * n
        passed = ((p - o) * u).sum(-1, keepdim=True) > -0.02                                # level with it or past
        target = torch.where(passed, g, waypoint)
        heading = _rotate(target - p, DEMO_HEADING_ERROR * (2 * self.demo_params[:, 0] - 1))
        step = DEMO_SPEED * heading / heading.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        close = (g - p).norm(dim=-1, keepdim=True) < DEMO_SPEED * MAX_STEP
        action = torch.where(passed & close, (g - p) / MAX_STEP, step)
        noise = DEMO_NOISE * torch.randn(self.num_envs, 2, generator=generator).to(self.device)
        return (action + noise).clamp(-1, 1)
