"""Notebook contract: paired .py/.ipynb in sync, reference outputs present, one parameters cell whose every
value is the notebook's config dataclass default (a field the cell leaves out takes that default too)."""
import dataclasses

import jupytext
import nbformat
import pytest
from jupytext.config import load_jupytext_config

from flowlib.infra.config import ConfigError
from flowlib.infra.runs import REPO_ROOT
from flowlib.tools.run import NOTEBOOK_CONFIGS, NOTEBOOK_GROUPS, _function, config_class, show_params

NB_DIR = REPO_ROOT / "notebooks"
SOURCES = sorted(NB_DIR.glob("[0-9]*.py"))
IDS = [p.stem for p in SOURCES]


def test_there_are_notebooks():
    assert SOURCES, "no notebooks/NN_name.py found"


@pytest.mark.parametrize("py", SOURCES, ids=IDS)
def test_pair_is_in_sync(py):
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.exists(), f"{py.name} has no paired {ipynb.name}: run `make sync`"
    config = load_jupytext_config(str(NB_DIR))
    from_ipynb = jupytext.writes(jupytext.read(ipynb), fmt="py:percent", config=config)
    assert from_ipynb == py.read_text(), (
        f"{ipynb.name} and {py.name} differ: edit the .py, then `make sync` (or `make notebooks` to refresh outputs)")


@pytest.mark.parametrize("py", SOURCES, ids=IDS)
def test_reference_outputs_are_committed(py):
    nb = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    unexecuted = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unexecuted, f"{py.stem}: code cells {unexecuted} have no stored outputs: run `make notebooks`"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("py", SOURCES, ids=IDS)
def test_parameters_cell_matches_the_config_dataclass(py):
    nb = jupytext.read(py)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{py.name}: expected exactly one cell tagged 'parameters', found {len(tagged)}"
    assert py.stem in NOTEBOOK_CONFIGS, f"register {py.stem}'s config class in flowlib.tools.run.NOTEBOOK_CONFIGS"
    namespace: dict = {}
    exec(tagged[0].source, namespace)
    defaults = {k: v for k, v in namespace.items() if not k.startswith("__")}
    fields = dataclasses.asdict(config_class(py.stem)())
    assert set(defaults) <= set(fields), f"{py.name}: not config fields: {sorted(set(defaults) - set(fields))}"
    differ = {k: (v, fields[k]) for k, v in defaults.items() if v != fields[k]}
    assert not differ, f"{py.name}: the parameters cell and the config dataclass defaults must agree: {differ}"


@pytest.mark.parametrize("py", SOURCES, ids=IDS)
def test_papermill_parses_every_parameter(py):
    """papermill reads the parameters cell line by line; a line it cannot parse (e.g. an ``=`` inside the
    comment) drops that parameter from ``papermill --help-notebook`` and makes every run that sets it warn
    'Passed unknown parameter', although the value is injected."""
    from papermill.translators import PythonTranslator

    nb = jupytext.read(py)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    parsed = {p.name for p in PythonTranslator.inspect(cell)}
    namespace: dict = {}
    exec(cell.source, namespace)
    unparsed = sorted(k for k in namespace if not k.startswith("__") and k not in parsed)
    assert not unparsed, (f"{py.name}: papermill cannot parse the parameters-cell lines of {unparsed}; "
                          "keep '=' out of their trailing comments")


DOCUMENTED = IDS  # every parameters cell is generated from its config dataclass (config.parameter_lines)


@pytest.mark.parametrize("stem", DOCUMENTED)
def test_a_documented_parameters_cell_is_typed_and_helped_as_its_dataclass_says(stem):
    """Each line is ``config.parameter_lines``'s ``name: type = value  # help``: ``papermill --help-notebook`` shows
    every parameter's type and help, and neither can drift from the dataclass (regenerate the cell after a change)."""
    from flowlib.infra.config import field_help, parameter_lines

    cls = config_class(stem)
    helps = field_help(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not helps.get(f.name)]
    assert not missing, f"{cls.__name__}: give these fields a one-line comment: {missing}"
    assert not [k for k, v in helps.items() if "=" in v], "papermill cannot parse an '=' in a parameter's help"
    cell = next(c for c in jupytext.read(NB_DIR / f"{stem}.py").cells if "parameters" in c.metadata.get("tags", []))
    lines = [line for line in cell.source.splitlines() if line and not line.startswith("#")]
    namespace: dict = {}
    exec(cell.source, namespace)
    values = {k: v for k, v in namespace.items() if not k.startswith("__")}
    assert lines == parameter_lines(cls, values)


@pytest.mark.parametrize("stem", sorted(NOTEBOOK_GROUPS))
def test_a_stage3_parameters_cell_is_grouped_by_method(stem):
    """Notebooks 03 and 06 list their parameters under a heading per dataclass, saying which methods read it, as
    ``--show-params`` prints them (regenerate with ``config.parameter_cell`` after a change)."""
    from flowlib.infra.config import parameter_cell

    cell = next(c for c in jupytext.read(NB_DIR / f"{stem}.py").cells if "parameters" in c.metadata.get("tags", []))
    lines = cell.source.splitlines()
    first = next(i for i, line in enumerate(lines) if not line.startswith("#")) - 1  # the first group's heading
    namespace: dict = {}
    exec(cell.source, namespace)
    values = {k: v for k, v in namespace.items() if not k.startswith("__")}
    groups = _function(NOTEBOOK_GROUPS[stem])(None)
    assert lines[first:] == parameter_cell(config_class(stem), values, groups)


def test_show_params_prints_only_the_groups_a_method_reads():
    td3 = "\n".join(show_params("06_steering", "residual_step/td3"))
    assert "td3_policy_delay: int = 2" in td3 and "# TD3Config: read by residual_step/td3" in td3
    assert "clip_coef" not in td3 and "sac_target_kl" not in td3  # PPO's and SAC's are not its options
    assert "clip_coef" in "\n".join(show_params("06_steering"))
    with pytest.raises(ConfigError, match="no stage-3 method 'residual_step/sac': choose one of .*residual_step/td3"):
        show_params("06_steering", "residual_step/sac")
    with pytest.raises(ConfigError, match="00_flows_2d has no stage-3 methods"):
        show_params("00_flows_2d", "chain/ppo")


def test_committed_notebooks_hold_no_volatile_metadata():
    """Execution timestamps, random cell ids and the Python patch version churn every diff: `make sync` and
    `make notebooks` strip them (nbstripout, keeping outputs and counts)."""
    import shlex
    import subprocess
    import sys

    strip = next(line for line in (REPO_ROOT / "Makefile").read_text().splitlines() if line.startswith("STRIP :="))
    args = shlex.split(strip.split(":=", 1)[1])
    nbs = [str(p.with_suffix(".ipynb")) for p in SOURCES]
    proc = subprocess.run([sys.executable, "-m", "nbstripout", "--verify", *args, *nbs], capture_output=True, text=True)
    assert proc.returncode == 0, f"run `make strip`: {proc.stdout}{proc.stderr}"
