"""Shared test set-up: one torch thread, the default dtype guard, and the lanes' markers kept honest.

Lanes (``make test`` runs them all; ``make test-fast`` leaves out ``sim`` and ``slow``):

* ``sim``: the test drives a real simulator (ManiSkill, Meta-World) or its demo tools (motion planning, replay,
  scripted experts);
* ``slow``: the test executes a notebook (papermill) or starts a service (a Ray head), or trains for more than
  ~10 s on 2 cores.

A test without the ``sim`` marker that builds a real simulator fails with the marker to add, and one without
``slow`` that executes a notebook does too: the fast lane cannot grow a simulator by accident.
"""
import functools

import pytest
import torch

from flowlib.envs import data, metaworld_envs
from flowlib.envs import maniskill as envs
from flowlib.policies import bc
from flowlib.tools import run, sweep

# One torch thread: tests share 2 cores with ManiSkill workers and nbval kernels, and two threads
# under contention made small steps 25x slower on the CI machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _default_dtype_is_not_leaked():
    """A test that changes torch's default dtype must restore it (ManiSkill breaks under float64)."""
    yield
    assert torch.get_default_dtype() == torch.float32, "a test left torch's default dtype changed"


def _refuse(what: str, marker: str, fn):
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        raise pytest.fail.Exception(f"this test {what}: mark it @pytest.mark.{marker} (tests/conftest.py), so that "
                                    f"`make test-fast` leaves it out")
    return guarded


def _refuse_real_demos(fn):
    @functools.wraps(fn)
    def guarded(env_id="PickCube-v1", *args, **kwargs):
        if not envs.is_fast(env_id):
            raise pytest.fail.Exception(f"this test generates {env_id} demos with the simulator's tools: mark it "
                                        "@pytest.mark.sim (tests/conftest.py), so that `make test-fast` leaves it out")
        return fn(env_id, *args, **kwargs)
    return guarded


@pytest.fixture(autouse=True)
def _lanes_are_marked(request, monkeypatch):
    """Unmarked tests may not reach a real simulator (``sim``) or run a notebook (``slow``)."""
    if request.node.get_closest_marker("sim") is None:
        for owner, name, what in [(envs.ManiSkillVecEnv, "__init__", "builds a ManiSkill env"),
                                  (metaworld_envs.MetaWorldVecEnv, "__init__", "builds a Meta-World env"),
                                  (metaworld_envs.MetaWorldTask, "__init__", "builds a Meta-World env"),
                                  (data, "expert_episodes", "runs Meta-World's scripted experts"),
                                  (data, "_run", "runs ManiSkill's demo tools")]:
            monkeypatch.setattr(owner, name, _refuse(what, "sim", getattr(owner, name)))
        for owner in (data, bc):  # bc holds its own name for it
            monkeypatch.setattr(owner, "generate_demos", _refuse_real_demos(owner.generate_demos))
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setattr(run, "execute", _refuse("executes a notebook", "slow", run.execute))
        monkeypatch.setattr(sweep, "run_job", _refuse("runs a sweep's notebook jobs", "slow", sweep.run_job))
    yield
