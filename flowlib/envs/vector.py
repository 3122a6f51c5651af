"""Vectorised CPU simulators: gymnasium's vector envs as ManiSkill's ``physx_cpu`` uses them (one env per process, no
auto-reset, envs that may be stepped after their episode ended), and ``EnvGroups`` for simulators whose step is short
next to a pipe's round trip (Meta-World's MuJoCo step, ~0.6 ms): each worker process steps a group of envs in a loop,
so one round trip serves the whole group (1.8x the env steps/s of gymnasium's one-env-per-process ``AsyncVectorEnv``
at 8 envs on 2 cores; benchmarks/metaworld_throughput.py)."""
from __future__ import annotations

import functools
import multiprocessing
import traceback

import numpy as np


@functools.cache
def steppable_sync_vector_env():
    """gymnasium's SyncVectorEnv for one in-process env, able to step an env whose episode ended."""
    import gymnasium as gym

    class SteppableSyncVectorEnv(gym.vector.SyncVectorEnv):
        """One env in this process (no IPC).  Gymnasium's SyncVectorEnv with autoreset off asserts when an
        ended env is stepped; chunked rollouts step every env to the chunk's end (as AsyncVectorEnv allows),
        and the simulators keep simulating (``truncated`` stays true): drop the flag."""

        def step(self, actions):
            self._autoreset_envs[:] = False
            return super().step(actions)

    return SteppableSyncVectorEnv


def vector_env(make, num_envs: int, in_process: bool):
    """``num_envs`` copies of ``make()`` with auto-reset off: in this process (``in_process``, one env), else one
    spawned worker process each (spawn, not fork: forking a process that already runs torch threads can deadlock)."""
    import gymnasium as gym
    from gymnasium.vector import AutoresetMode

    if in_process:
        return steppable_sync_vector_env()([make] * num_envs, autoreset_mode=AutoresetMode.DISABLED)
    return gym.vector.AsyncVectorEnv([make] * num_envs, autoreset_mode=AutoresetMode.DISABLED, daemon=True,
                                     context="spawn")


def _serve(conn, make_group, indices) -> None:
    """A worker's loop: build its group, then run ``(method, args)`` commands on it until ``close``; an error goes
    back to the parent as its traceback."""
    try:
        group = make_group(indices)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        name, args = conn.recv()
        if name == "close":
            group.close()
            return
        try:
            conn.send(("ok", getattr(group, name)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class EnvGroups:
    """``num_envs`` envs split into ``num_workers`` contiguous groups (``slices``), each ``make_group(indices)`` held by
    one spawned worker process; ``num_workers = 0``: one group in this process.  ``call(method, per_group_args)``
    runs ``group.method(*args)`` in every group at once and returns their results in group order."""

    def __init__(self, make_group, num_envs: int, num_workers: int):
        if not 0 <= num_workers <= num_envs:
            raise ValueError(f"num_workers must be in [0, num_envs={num_envs}], got {num_workers}")
        self.slices = [list(map(int, s)) for s in np.array_split(np.arange(num_envs), max(1, num_workers))]
        self.local, self.pipes, self.procs = None, [], []
        if num_workers == 0:
            self.local = make_group(self.slices[0])
            return
        ctx = multiprocessing.get_context("spawn")  # not fork: forking a process that runs torch threads can deadlock
        for indices in self.slices:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, make_group, indices), daemon=True)
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
        self._gather()  # each worker's group built, or its error raised here

    def call(self, name: str, per_group_args: list[tuple] | None = None) -> list:
        args = per_group_args or [()] * len(self.slices)
        if self.local is not None:
            return [getattr(self.local, name)(*args[0])]
        for pipe, a in zip(self.pipes, args):
            pipe.send((name, a))
        return self._gather()

    def _gather(self) -> list:
        out = []
        for pipe in self.pipes:
            status, value = pipe.recv()
            if status == "error":
                self.close()
                raise RuntimeError(f"an env worker failed:\n{value}")
            out.append(value)
        return out

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        for pipe in self.pipes:
            try:
                pipe.send(("close", ()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
        self.local, self.pipes, self.procs = None, [], []
