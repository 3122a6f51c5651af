"""Where flowlib's flat modules went when the package took its layer folders, so that old paths keep working for one
release: imports in notebooks and scripts written before the move, saved checkpoints (pickles name their classes'
modules) and the commands in results/*/record.json.

* ``import flowlib.bc`` / ``from flowlib import bc`` / ``from flowlib.bc import X`` give the module that now lives at
  ``flowlib.policies.bc`` (the same object), with a FutureWarning that names the new path.
* The command lines keep their short names for good, without a warning: ``python -m flowlib.run`` runs
  ``flowlib/tools/run.py`` (likewise evaluate, results, seeds, sweep, export and sysdeps).
* ``flowlib.flows.ShortCut`` and ``flowlib.envs.make_env``, names of the two old modules whose names are now
  packages, resolve through the packages' ``__getattr__`` (``old_names_of``), with the same warning.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

LAYOUT = {  # package -> its modules, bottom layer first (docs/architecture.md; tests/test_layers.py reads it)
    "infra": ("config", "runs", "tracking", "progress", "guards", "sysdeps", "schedules", "metrics", "grad_signal"),
    "flows": ("models", "nets", "unet", "flow_sde", "toy2d"),
    "envs": ("tasks", "maniskill", "metaworld_envs", "fast_envs", "vector", "visual", "visual_demos", "data", "smdp"),
    "policies": ("encoders", "chunk_policy", "policy_eval", "bc", "critic", "awsc"),
    "rl": ("ppo", "buffers", "loop", "learners", "asymmetric"),
    "methods": ("reinflow_agent", "reinflow", "steering", "latent", "latent_sac", "residual", "residual_step",
                "residual_td3", "gaussian", "rfc", "fql", "stage3"),
    "tools": ("run", "evaluate", "results", "seeds", "sweep", "export", "bench", "pirl"),
}
RENAMED = {"models": "flows", "maniskill": "envs"}  # the two modules whose old names are now their packages
MOVED = {f"flowlib.{module}": f"flowlib.{package}.{module}"  # old path -> new path
         for package, modules in LAYOUT.items() for module in modules if module not in RENAMED}
COMMANDS = {f"flowlib.{name}" for name in ("run", "evaluate", "results", "seeds", "sweep", "export", "sysdeps")}
NEXT_RELEASE = "the old path goes in the next release"


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}: import it from there ({NEXT_RELEASE})", FutureWarning, stacklevel=3)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder for the old flat paths (``MOVED``): the module object is the one at its new path, so classes,
    isinstance checks and module state are shared; ``get_code`` lets ``python -m flowlib.run`` run the new file."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=importlib.util.find_spec(new).origin)

    def create_module(self, spec):
        new = MOVED[spec.name]
        if spec.name not in COMMANDS:
            _warn(spec.name, new)
        module = importlib.import_module(new)
        return module

    def exec_module(self, module):
        # importlib set the module's __spec__ to the old name's; put back the real one (its name is the new path)
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__, module.__file__)

    def get_code(self, fullname):
        new = MOVED[fullname]
        return importlib.util.find_spec(new).loader.get_code(new)


def old_names_of(package: str, module: str):
    """A package ``__getattr__`` (PEP 562) for the names of the old flat module ``package`` that now lives at
    ``module``: ``flowlib.envs.make_env`` still resolves, with a FutureWarning."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        target = importlib.import_module(module)
        if not hasattr(target, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{package}.{name}", f"{module}.{name}")
        value = getattr(target, name)
        setattr(sys.modules[package], name, value)  # warned once; the package serves it from now on
        return value

    return __getattr__


def moved_names(module: str, names: dict[str, str]):
    """A module ``__getattr__`` (PEP 562) for names that left ``module`` for another (``names``: name -> its new
    module): ``flowlib.methods.residual_step.NStepReturns`` still resolves, with a FutureWarning."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{names[name]}.{name}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
