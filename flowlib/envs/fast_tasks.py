"""The fast torch tasks by name (what ``make_env`` and the demos look up), and their scripted demonstrators."""
from __future__ import annotations

from flowlib.envs.fast_avoid import FastAvoid
from flowlib.envs.fast_envs import FastPush, FastReach, demonstrate

FAST_TASKS = {cls.env_id: cls for cls in (FastReach, FastPush, FastAvoid)}

__all__ = ["FAST_TASKS", "demonstrate"]
