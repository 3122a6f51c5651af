"""Typed, validated run configuration.

Each notebook's parameters are one dataclass.  Values come from three places, in this order:
the dataclass defaults (= the notebook's ``parameters`` cell), a YAML file under ``params/``,
and papermill's ``-p`` overrides.  Whatever the source, an unknown key, a value of the wrong
type, out of its field's range (``num_envs: PositiveInt``) or not finite (NaN, inf), or one that
fails a check across fields (the dataclass's ``__post_init__``) stops the run with a
``ConfigError`` naming the key and what to do.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Mapping, TypeVar

import yaml
from pydantic import (  # noqa: F401 (re-exported)
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    ValidationError,
)

T = TypeVar("T")

# Field types with a range, checked by ``validate`` (pydantic's constrained types; PositiveInt is > 0, ...).
Fraction = Annotated[float, Field(ge=0, le=1)]   # a share, probability or decay rate in [0, 1]
_FINITE = ConfigDict(allow_inf_nan=False)        # NaN or inf is never a parameter
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))

# Names IPython puts in a notebook's globals that are plain values, not parameters.
_IPYTHON_NAMES = {"In", "Out", "exit", "quit", "get_ipython"}
_PLAIN = (bool, int, float, str, list, tuple, dict, type(None))


class ConfigError(ValueError):
    """A parameter file or override does not fit the notebook's configuration."""


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def defaults(cls) -> dict[str, Any]:
    """Each field's default value (a fresh one from its ``default_factory``), without building the config."""
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


def validate(cls: type[T], values: Mapping[str, Any], source: str = "parameters") -> T:
    """Build ``cls`` from ``values``; reject unknown keys, wrong types, values out of range or not finite,
    and failed cross-field checks, each with a message naming the key (``ConfigError``)."""
    allowed = field_names(cls)
    unknown = [k for k in values if k not in allowed]
    if unknown:
        hints, renamed = [], getattr(cls, "RENAMED", {})  # old name -> new name
        for k in unknown:
            close = [renamed[k]] if k in renamed else closest(k, allowed)
            hints.append(f"{k!r}" + (f" (renamed {close[0]!r})" if k in renamed else
                                     f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"{source}: unknown parameter {', '.join(hints)} for {cls.__name__}. "
            f"Allowed keys: {', '.join(allowed)}. Fix the key or remove it."
        )
    clean, problems = _checked(cls, values)
    if problems:
        raise ConfigError(f"{source}: bad value for {cls.__name__}: " + "; ".join(problems))
    try:
        return cls(**clean)
    except ValueError as err:  # a check across fields, in the dataclass's __post_init__
        raise ConfigError(f"{source}: {err}") from err


# Abbreviations in field names, spelled out when a mistyped key is matched (``actor_lerning_rate`` -> ``actor_lr``).
_ABBREVIATIONS = {"lr": "learning_rate", "ckpt": "checkpoint", "obs": "observation", "eval": "evaluation",
                  "coef": "coefficient", "ent": "entropy", "vf": "value_function", "adv": "advantage",
                  "num": "number", "dims": "dimensions", "std": "standard_deviation"}


def _spelled_out(name: str) -> str:
    return "_".join(_ABBREVIATIONS.get(w, w) for w in name.split("_"))


def closest(key: str, allowed: list[str]) -> list[str]:
    """The allowed name a mistyped ``key`` most likely meant (``[]`` if none is close), compared with the
    abbreviations in both spelled out, so that ``actor_lerning_rate`` finds ``actor_lr``."""
    spelled = {_spelled_out(a): a for a in allowed}
    match = difflib.get_close_matches(_spelled_out(key), list(spelled), n=1, cutoff=0.7)
    return [spelled[match[0]]] if match else difflib.get_close_matches(key, allowed, n=1)


def check_fields(cfg) -> None:
    """For ``__post_init__``: every field of its type, in its range and finite, also for a config built in
    code (``Stage3Config(num_envs=0)``, ``dataclasses.replace``), not only for one read by ``validate``."""
    _, problems = _checked(type(cfg), {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    if problems:
        raise ConfigError(f"bad value for {type(cfg).__name__}: " + "; ".join(problems))


def _checked(cls, values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` as ``cls``'s field types parse them, and one problem per value that does not fit.
    Strict: no silent casts ("3" is not an int, 1.5 is not an int); ints pass as floats."""
    clean, problems = {}, []
    for key, value in values.items():
        adapter, hint = _adapter(cls, key)
        try:
            clean[key] = adapter.validate_python(value, strict=True)
        except ValidationError as err:
            first = err.errors()[0]  # "Input should be greater than 0", at loc (1,) of a list
            item = "".join(f"[{i!r}]" for i in first["loc"])
            should = first["msg"].replace("Input should", "should", 1)
            problems.append(f"{key!r}{item} = {first['input']!r}: {should} (expected {_type_name(hint)})"
                            + _list_hint(key, hint, value))
    return clean, problems


@functools.cache
def _adapter(cls, key: str):
    hint = typing.get_type_hints(cls, include_extras=True)[key]
    return TypeAdapter(hint, config=_FINITE), hint


def _list_hint(key: str, hint, value) -> str:
    """How to pass a list, when one arrived as a string (papermill's ``-p`` passes every value as a string)."""
    base = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    if typing.get_origin(base) is not list or not isinstance(value, str):
        return ""
    items = value.strip("[]") or "..."
    return (f"; a list given as text: write -p '{key}=[{items}]' for python -m flowlib.run, "
            f"or -y '{key}: [{items}]' for papermill (its -p passes strings)")


def _type_name(tp) -> str:
    """The expected type as a reader writes it: ``int``, ``int > 0``, ``list of float >= 0, <= 1``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        base, *meta = args
        constraints = [c for m in meta for c in getattr(m, "metadata", [m])]  # a pydantic Field holds its own
        bounds = [f"{op} {getattr(c, name)}" for c in constraints for name, op in _BOUNDS if hasattr(c, name)]
        return " ".join([_type_name(base), ", ".join(bounds)]).strip()
    if origin is list:
        return f"list of {_type_name(args[0])}"
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


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


def parse_yaml(text: str, source: str = "value") -> Any:
    """YAML as parameter files use it; text that is not valid YAML is a ``ConfigError`` naming ``source`` and
    the line and column where the parser stopped."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source} is not valid YAML{where}: {what}; check the brackets and quotes there"
                          ) from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a parameter file: a YAML mapping of parameter names to values."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"parameter file {path} does not exist; see params/ for the available ones")
    data = parse_yaml(path.read_text(), source=f"parameter file {path}") or {}
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


# The help of parameters that several notebooks share, unless a class's own comment says more.
COMMON_HELP = {
    "seed": "seed of torch and of the run's random draws",
    "env_id": "the task: a ManiSkill id (PickCube-v1) or a fast torch task (FastReach-v0, FastPush-v0)",
    "num_demos": "demonstrations to clone (generated once, then cached)",
    "obs_horizon": "observations the policy conditions on (T_o)",
    "pred_horizon": "actions per predicted chunk (H)",
    "act_horizon": "actions of each chunk executed before replanning (T_a)",
    "ema_decay": "decay of the weights' exponential moving average (the evaluated policy)",
    "train_steps": "gradient steps",
    "batch_size": "samples per gradient step",
    "lr": "peak learning rate (AdamW, cosine decay)",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear learning-rate warm-up steps",
    "ckpt_every": "write last.pt every this many steps (a run resumes from it)",
    "log_every": "log the losses every this many steps",
    "eval_every": "evaluate every this many steps (0 means only at the end)",
    "eval_inference_steps": "integration steps K at which the final report evaluates",
    "num_eval_episodes": "held-out episodes per evaluation",
    "num_envs": "parallel envs",
    "max_episode_steps": "env steps per episode",
    "backend": "auto, physx_cpu or physx_cuda (a fast task maps them to torch_cpu or torch_cuda)",
    "num_threads": "torch CPU threads (0 means torch's default)",
    "resume": "go on from the run folder's last.pt when there is one",
    "run_name": "the run folder, outputs/<notebook>/<run_name>",
    "wandb_mode": "disabled, offline (a local W&B run) or online",
}


def field_help(cls) -> dict[str, str]:
    """Each field's help on one line: the comment after its declaration (with the comment-only lines that continue
    it) in the class, or in the nearest base class that has one (a subclass that only changes defaults keeps its
    bases' help), else ``COMMON_HELP``'s."""
    out: dict[str, str] = {}
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        # the comment after the declaration, and the comment-only lines below it indented past the fields (a section
        # comment between fields sits at the fields' indent and is not one)
        for m in re.finditer(r"^    (\w+): [^=\n]+=[^\n#]*#\s*(.+)$((?:\n[ \t]{5,}#.*$)*)", inspect.getsource(klass), re.M):
            more = [line.strip().lstrip("#").strip() for line in m.group(3).splitlines() if line.strip()]
            out.setdefault(m.group(1), " ".join([m.group(2).strip(), *more]))
    names = {f.name for f in dataclasses.fields(cls)}
    return {**{k: v for k, v in COMMON_HELP.items() if k in names}, **out}


def type_name(cls, name: str) -> str:
    """A field's Python type as papermill reads an annotation: ``int``, ``float``, ``list[int]`` (no bounds)."""
    def plain(tp):
        if typing.get_origin(tp) is Annotated:
            return plain(typing.get_args(tp)[0])
        if typing.get_origin(tp) is list:
            return f"list[{plain(typing.get_args(tp)[0])}]"
        return tp.__name__
    return plain(typing.get_type_hints(cls, include_extras=True)[name])


def parameter_lines(cls, values: Mapping[str, Any]) -> list[str]:
    """A notebook's parameters-cell lines ``name: type = value  # help`` for ``values``, in their order, each
    annotated and documented as ``papermill --help-notebook`` shows them."""
    helps = field_help(cls)

    def text(v):  # Python source, strings in double quotes as the notebooks write them
        if isinstance(v, str) and '"' not in v:
            return f'"{v}"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(map(text, v)) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{text(k)}: {text(x)}" for k, x in v.items()) + "}"
        return repr(v)

    def line(k, v):
        return f"{k}: {type_name(cls, k)} = {text(v)}" + (f"  # {helps[k]}" if helps.get(k) else "")
    return [line(k, v) for k, v in values.items()]


def parameter_cell(cls, values: Mapping[str, Any], groups: list[tuple[str, list[str]]]) -> list[str]:
    """``parameter_lines`` under a ``# heading`` line per group (``groups``: heading, field names in order); the
    fields of ``values`` no group names come last, under "# other".  papermill reads the lines as one flat list, so
    ``papermill --help-notebook`` still shows every parameter; the headings are for a reader of the cell."""
    out, placed = [], set()
    for heading, names in [*groups, ("other", list(values))]:
        names = [n for n in names if n in values and n not in placed]
        if names:
            out += [f"# {heading}", *parameter_lines(cls, {n: values[n] for n in names})]
            placed |= set(names)
    return out


def require(checks: list[tuple[bool, str]]) -> None:
    """For ``__post_init__``: raise ``ValueError`` with the message of the first failed check."""
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
