"""Run a notebook headlessly with papermill over a parameter file.

    python -m flowlib.run 00_flows_2d                                  # notebook defaults
    python -m flowlib.run 00_flows_2d --params params/00_flows_2d/full.yaml
    python -m flowlib.run 00_flows_2d -p train_steps=500 -p targets='[two_moons]' --run-name quick

The parameters (file, then ``-p`` overrides, values parsed as YAML) are validated against the
notebook's config dataclass *before* the kernel starts; the executed notebook is written to
``outputs/<notebook>/<run_name>/<notebook>.ipynb`` next to the run's metrics and figures.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from flowlib.infra.config import ConfigError, defaults, load_yaml, parameter_cell, parse_yaml, validate
from flowlib.infra.progress import LINES, PROGRESS_ENV, say
from flowlib.infra.runs import REPO_ROOT, check_run_name, checkpoint_location, run_dir, run_that_writes, shown
from flowlib.policies.chunk_policy import checkpoint_meta, flow_problem

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"

# notebook -> its parameters dataclass ("module:Class")
NOTEBOOK_CONFIGS = {
    "00_flows_2d": "flowlib.flows.toy2d:Flows2DConfig",
    "01_shortcut_bc": "flowlib.policies.bc:ShortCutBCConfig",
    "02_aw_shortcut": "flowlib.policies.awsc:AWShortCutConfig",
    "03_reinflow": "flowlib.methods.stage3:ChainPPOConfig",
    "06_steering": "flowlib.methods.stage3:SteeringConfig",
    "04_flow_sde": "flowlib.tools.pirl:FlowSDEConfig",
    "05_ablation_report": "flowlib.tools.sweep_report:SweepReportConfig",
}


# notebook -> the parameter naming the checkpoint it starts from, and the function from config to that path
# ("module:function"; FileNotFoundError saying how to make it)
NOTEBOOK_INPUTS = {
    "02_aw_shortcut": ("stage1_checkpoint", "flowlib.policies.awsc:stage1_checkpoint_path"),
    "03_reinflow": ("init_checkpoint", "flowlib.methods.stage3:init_checkpoint_path"),
    "06_steering": ("init_checkpoint", "flowlib.methods.stage3:init_checkpoint_path"),
    "04_flow_sde": ("init_checkpoint", "flowlib.tools.pirl:init_checkpoint_path"),
}

# notebooks that make their *default* start checkpoint when it is missing (``start_checkpoint``): the chain-PPO
# tutorial and the noise methods' comparison train their fast-task start in half a minute.  A start named in params
# must exist, as everywhere.
MAKES_ITS_START = {"03_reinflow", "04_flow_sde"}

# notebook -> a check of its parameters against the files they name ("module:function", config -> problem or "")
NOTEBOOK_PREFLIGHT = {
    "02_aw_shortcut": "flowlib.policies.awsc:rollout_problem",
    "03_reinflow": "flowlib.methods.stage3:start_problem",
    "06_steering": "flowlib.methods.stage3:start_problem",
}

# notebooks whose parameters come in groups (``--show-params``, and the order of their parameters cells)
NOTEBOOK_GROUPS = {"03_reinflow": "flowlib.methods.registry:parameter_groups",
                   "06_steering": "flowlib.methods.registry:parameter_groups"}


def _function(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def config_class(notebook: str):
    if notebook not in NOTEBOOK_CONFIGS:
        raise ConfigError(f"unknown notebook {notebook!r}; choose one of {sorted(NOTEBOOK_CONFIGS)}")
    return _function(NOTEBOOK_CONFIGS[notebook])


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        out[key.strip()] = parse_yaml(value, source=f"-p {key.strip()}={value}")
    return out


def resolve_parameters(notebook: str, params_file: str | None = None, overrides: dict[str, Any] | None = None,
                       run_name: str | None = None) -> dict[str, Any]:
    """The parameters papermill will inject, validated against the notebook's config class."""
    values: dict[str, Any] = dict(load_yaml(params_file)) if params_file else {}
    values.update(overrides or {})
    if run_name is not None:
        values["run_name"] = run_name
    elif params_file and "run_name" not in values:
        values["run_name"] = params_run_name(params_file)
    cfg = validate(config_class(notebook), values, source=params_file or "overrides")
    try:
        check_run_name(cfg.run_name)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return values


def show_params(notebook: str, method: str = "") -> list[str]:
    """Every parameter of ``notebook`` with its type, default and help, grouped as its parameters cell groups them
    (notebooks 03 and 06: by the dataclass that declares it, with the methods that read it); with ``method``
    (``steer/learner``, notebooks 03 and 06) only the groups that method reads."""
    cls = config_class(notebook)
    values = defaults(cls)
    if notebook not in NOTEBOOK_GROUPS:
        if method:
            raise ConfigError(f"{notebook} has no stage-3 methods: --show-params takes no method there")
        return parameter_cell(cls, values, [])
    pair = tuple(method.split("/")) if method else None
    try:
        groups = _function(NOTEBOOK_GROUPS[notebook])(pair)
    except ValueError as err:  # a pair the registry does not hold
        raise ConfigError(str(err)) from err
    if pair is not None:
        values = {n: values[n] for _, names in groups for n in names}
    return parameter_cell(cls, values, groups)


def params_run_name(params_file: str | Path) -> str:
    """The run folder a params file names: its path under ``params/<notebook>/`` without ``.yaml``, ``/`` as ``-``
    (``params/03_reinflow/ablations/baseline.yaml`` -> ``ablations-baseline``); a file elsewhere, its stem."""
    path = Path(params_file).resolve().with_suffix("")
    try:
        return "-".join(path.relative_to(REPO_ROOT / "params").parts[1:])
    except ValueError:
        return path.name


def preflight(notebook: str, parameters: dict[str, Any], require_inputs: bool = True) -> str:
    """Why these (valid) parameters cannot run, from the files they name ("" if they can or nobody checks).
    ``require_inputs=False`` lets a start checkpoint be missing: a sweep may be planned before stage 1 ran."""
    cfg = validate(config_class(notebook), parameters)
    if notebook in NOTEBOOK_INPUTS:
        key, path_of = NOTEBOOK_INPUTS[notebook]
        try:
            problem = start_checkpoint_problem(_function(path_of)(cfg), key, cfg.env_id)
        except FileNotFoundError as err:
            problem = str(err) if require_inputs and not makes_its_start(notebook, cfg) else ""
        if problem:
            return problem
    return _function(NOTEBOOK_PREFLIGHT[notebook])(cfg) if notebook in NOTEBOOK_PREFLIGHT else ""


def makes_its_start(notebook: str, cfg) -> bool:
    """Whether ``notebook`` makes the start checkpoint ``cfg`` names when it is missing: its default start, in a
    notebook of ``MAKES_ITS_START``, written by a params file of notebook 01 or 02."""
    if notebook not in MAKES_ITS_START:
        return False
    key = NOTEBOOK_INPUTS[notebook][0]
    value = getattr(cfg, key)
    return value == defaults(config_class(notebook))[key] and run_that_writes(checkpoint_location(value)) is not None


def start_checkpoint(notebook: str, cfg) -> Path:
    """The start checkpoint of ``notebook``'s run with ``cfg``: made first when the notebook makes its default start
    (``makes_its_start``), else the path its parameter names, which must exist (``FileNotFoundError`` saying how to
    make it)."""
    key, path_of = NOTEBOOK_INPUTS[notebook]
    if makes_its_start(notebook, cfg):
        return ensure_checkpoint(checkpoint_location(getattr(cfg, key)))
    return _function(path_of)(cfg)


def ensure_checkpoint(path: Path) -> Path:
    """``path``, first made by the run that writes it when it is missing (notebook 01's or 02's params file,
    ``runs.run_that_writes``), as ``python -m flowlib.run <notebook> --params <file>`` would; else
    ``FileNotFoundError`` saying how to make it."""
    path = Path(path)
    if path.is_file():
        return path
    run = run_that_writes(path)
    if run is None:
        raise FileNotFoundError(f"checkpoint {path} not found, and no params file of notebook 01 or 02 writes it: "
                                "run the stage that makes it first")
    notebook, params = run
    say(f"{shown(path)} is missing: running {notebook}" + (f" --params {params}" if params else "") + " first")
    execute(notebook, resolve_parameters(notebook, str(REPO_ROOT / params) if params else None))
    if not path.is_file():
        raise FileNotFoundError(f"{notebook}'s run finished without writing {path}")
    return path


def start_checkpoint_problem(path: Path, key: str, env_id: str) -> str:
    """Why the flow-policy checkpoint ``path`` (parameter ``key``) cannot start a run on ``env_id`` ("" if it can):
    not a torch file, not a stage-1/2 policy, stage 1's diffusion baseline (every later stage reads the flow), or a
    policy of another task."""
    try:
        meta = checkpoint_meta(path)
    except ValueError as err:
        return f"{key}: {err}"
    if problem := flow_problem(meta, path, "this run"):
        return f"{key}: {problem}"
    if meta["env_id"] != env_id:
        return (f"{key}: {path} is a policy for {meta['env_id']}, this run is for {env_id}: set env_id: "
                f"{meta['env_id']} or point {key} at a {env_id} policy")
    return ""


# The kernel's own start-up warning about TCP transport (papermill's kernels talk over localhost) is noise in
# every run's terminal; the kernel logs errors only.
KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=ERROR"]


def execute(notebook: str, parameters: dict[str, Any], kernel: str = "python3", stream: bool = True) -> Path:
    """Execute ``notebooks/<notebook>.ipynb`` with ``parameters``; return the executed copy's path.  With
    ``stream``, what the notebook prints (stage lines, ``flowlib.infra.progress`` lines) is shown here as it runs."""
    import papermill as pm

    cfg = validate(config_class(notebook), parameters)
    out_dir = run_dir(notebook, cfg.run_name)
    out_path = out_dir / f"{notebook}.ipynb"
    streams = dict(stdout_file=sys.stdout, stderr_file=sys.stderr) if stream else {}
    # papermill warns of every parameter its parameters cell does not list; a notebook's cell shows the knobs a
    # reader turns, and validate() above has checked every key against the whole config
    logging.getLogger("papermill").setLevel(logging.ERROR)
    before = os.environ.get(PROGRESS_ENV)
    os.environ[PROGRESS_ENV] = LINES  # the kernel inherits it: progress as lines, which papermill streams
    try:
        pm.execute_notebook(str(NOTEBOOKS_DIR / f"{notebook}.ipynb"), str(out_path), parameters=parameters,
                            kernel_name=kernel, cwd=str(NOTEBOOKS_DIR), progress_bar=False,
                            extra_arguments=KERNEL_ARGUMENTS, **streams)
    finally:  # a notebook that calls this (ensure_checkpoint) keeps its own progress bars
        if before is None:
            os.environ.pop(PROGRESS_ENV)
        else:
            os.environ[PROGRESS_ENV] = before
    return out_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowlib.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook", help=f"one of {sorted(NOTEBOOK_CONFIGS)}")
    ap.add_argument("--params", help="YAML parameter file (e.g. params/00_flows_2d/full.yaml)")
    ap.add_argument("-p", "--set", action="append", default=[], metavar="KEY=VALUE", help="override one parameter")
    ap.add_argument("--run-name", help="folder under outputs/<notebook>/ (default: the params file's stem, else 'default')")
    ap.add_argument("--kernel", default="python3")
    ap.add_argument("--quiet", action="store_true", help="do not show the notebook's output here as it runs")
    ap.add_argument("--show-params", nargs="?", const="", metavar="STEER/LEARNER",
                    help="print the notebook's parameters, grouped, with their help, and stop; notebooks 03 and 06: "
                         "with a method (residual_step/td3), only the groups it reads")
    args = ap.parse_args(argv)
    if args.show_params is not None:
        try:
            print("\n".join(show_params(args.notebook, args.show_params)))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        params = resolve_parameters(args.notebook, args.params, parse_overrides(args.set), args.run_name)
        problem = preflight(args.notebook, params)
        if problem:
            raise ConfigError(problem)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    folder = run_dir(args.notebook, validate(config_class(args.notebook), params).run_name)
    print(f"{args.notebook}: run folder {shown(folder)}", flush=True)
    try:
        out = execute(args.notebook, params, kernel=args.kernel, stream=not args.quiet)
    except Exception as err:  # papermill's PapermillExecutionError: the cell that failed, kept in the copy
        if type(err).__name__ != "PapermillExecutionError":
            raise
        copy = shown(folder / f"{args.notebook}.ipynb")
        print(f"error: {args.notebook} stopped at cell {err.exec_count} with {err.ename}: {err.evalue}; "
              f"the traceback is in {copy}", file=sys.stderr)
        return 1
    print(f"{args.notebook}: done -> {shown(out.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
