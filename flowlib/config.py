"""Typed, validated run configuration.

Each notebook's parameters are one dataclass.  Values come from three places, in this order:
the dataclass defaults (= the notebook's ``parameters`` cell), a YAML file under ``params/``,
and papermill's ``-p`` overrides.  Whatever the source, an unknown key or a value of the wrong
type stops the run with a message naming the key and the allowed ones.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml
from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")

# Names IPython puts in a notebook's globals that are plain values, not parameters.
_IPYTHON_NAMES = {"In", "Out", "exit", "quit", "get_ipython"}
_PLAIN = (bool, int, float, str, list, tuple, dict, type(None))


class ConfigError(ValueError):
    """A parameter file or override does not fit the notebook's configuration."""


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def validate(cls: type[T], values: Mapping[str, Any], source: str = "parameters") -> T:
    """Build ``cls`` from ``values``; reject unknown keys and wrong types with a clear message."""
    allowed = field_names(cls)
    unknown = [k for k in values if k not in allowed]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, allowed, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"{source}: unknown parameter {', '.join(hints)} for {cls.__name__}. "
            f"Allowed keys: {', '.join(allowed)}. Fix the key or remove it."
        )
    # Strict per field: no silent casts ("3" is not an int, 1.5 is not an int); ints pass as floats.
    hints = typing.get_type_hints(cls)
    problems, clean = [], {}
    for key, value in values.items():
        try:
            clean[key] = TypeAdapter(hints[key]).validate_python(value, strict=True)
        except ValidationError as err:
            msg = err.errors()[0]["msg"]
            problems.append(f"{key!r} = {value!r} ({msg}; expected {_type_name(hints[key])})")
    if problems:
        raise ConfigError(f"{source}: wrong type for {cls.__name__}: " + "; ".join(problems))
    return cls(**clean)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "")


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float (YAML 1.1 would make it a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a parameter file: a YAML mapping of parameter names to values."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"parameter file {path} does not exist; see params/ for the available ones")
    data = parse_yaml(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of parameter names to values, got {type(data).__name__}")
    return data


def from_yaml(cls: type[T], path: str | Path, overrides: Mapping[str, Any] | None = None) -> T:
    """``cls`` from a YAML parameter file plus optional overrides."""
    values = {**load_yaml(path), **(overrides or {})}
    return validate(cls, values, source=str(path))


def from_globals(cls: type[T], namespace: Mapping[str, Any]) -> T:
    """``cls`` from a notebook's globals, right after its ``parameters`` cell.

    Every plain value (number, string, bool, list, dict, None) whose name does not start with
    ``_`` counts as a parameter: the ones in the ``parameters`` cell and any that papermill
    injected.  So a mistyped ``-p lerning_rate 1e-3`` is an unknown key here, not a silent no-op.
    """
    values = {k: v for k, v in namespace.items()
              if not k.startswith("_") and k not in _IPYTHON_NAMES and isinstance(v, _PLAIN)}
    return validate(cls, values, source="notebook parameters")


def require(checks: list[tuple[bool, str]]) -> None:
    """For ``__post_init__``: raise ``ValueError`` with the message of the first failed check."""
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
