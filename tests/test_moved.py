"""The paths of before the layer folders keep working for one release (flowlib/_moved.py): old imports give the
same module with a FutureWarning naming the new path, pickles that name old modules load, and the commands keep
their short names without a warning."""
import pickle
import subprocess
import sys
import warnings

import pytest

from flowlib import _moved


def test_an_old_module_path_is_the_new_module_with_a_warning_naming_it():
    sys.modules.pop("flowlib.critic", None)
    with pytest.warns(FutureWarning, match=r"flowlib\.critic moved to flowlib\.policies\.critic"):
        import flowlib.critic as old
    import flowlib.policies.critic as new
    assert old is new
    assert new.__spec__.name == "flowlib.policies.critic"  # the real spec, not the alias's


def test_old_names_of_a_module_that_became_a_package_resolve_with_a_warning():
    import flowlib.envs
    from flowlib.envs.maniskill import resolve_backend
    flowlib.envs.__dict__.pop("resolve_backend", None)
    with pytest.warns(FutureWarning, match=r"flowlib\.envs\.resolve_backend moved to flowlib\.envs\.maniskill"):
        from flowlib.envs import resolve_backend as old
    assert old is resolve_backend
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        flowlib.envs.no_such_name  # noqa: B018


def test_a_pickle_that_names_an_old_module_loads():
    """Checkpoints are pickles: one written before the move names ``flowlib.data.Normalizer`` (protocol 0 is text,
    so the name can be edited in place)."""
    from flowlib.envs.data import Normalizer
    blob = pickle.dumps(Normalizer.__new__(Normalizer), protocol=0).replace(b"flowlib.envs.data", b"flowlib.data")
    assert b"flowlib.data" in blob
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert type(pickle.loads(blob)) is Normalizer


@pytest.mark.parametrize("command", sorted(_moved.COMMANDS - {"flowlib.sysdeps", "flowlib.export", "flowlib.sweep"}))
def test_the_commands_keep_their_short_names_without_a_warning(command):
    out = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-m", command, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"python -m {command}" in out.stdout or "usage" in out.stdout


def test_a_name_that_left_a_split_module_resolves_with_a_warning():
    from flowlib.methods import residual_step
    from flowlib.rl.buffers import NStepReturns
    residual_step.__dict__.pop("NStepReturns", None)
    with pytest.warns(FutureWarning, match=r"residual_step\.NStepReturns moved to flowlib\.rl\.buffers\.NStepReturns"):
        assert residual_step.NStepReturns is NStepReturns
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        residual_step.nothing_here  # noqa: B018
