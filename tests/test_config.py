"""Parameter validation, the notebook runner's checks, and every params/ file."""
import dataclasses
from pathlib import Path

import pytest

from flowlib.config import ConfigError, from_globals, from_yaml, parse_yaml, validate
from flowlib.run import NOTEBOOK_CONFIGS, config_class, main, resolve_parameters
from flowlib.runs import REPO_ROOT
from flowlib.toy2d import Flows2DConfig


def test_unknown_key_names_the_key_the_suggestion_and_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        validate(Flows2DConfig, {"train_step": 10})
    msg = str(err.value)
    assert "'train_step'" in msg and "did you mean 'train_steps'" in msg and "Allowed keys: seed," in msg


@pytest.mark.parametrize("key, value", [("train_steps", "100"), ("train_steps", 1.5), ("lr", "fast"),
                                        ("targets", "two_moons"), ("seed", True)])
def test_wrong_types_are_rejected_not_cast(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        validate(Flows2DConfig, {key: value})


def test_ints_pass_as_floats_and_yaml_reads_exponents_as_floats():
    assert validate(Flows2DConfig, {"lr": 1}).lr == 1.0
    assert parse_yaml("lr: 1e-3") == {"lr": 0.001}


def test_bad_values_are_rejected_by_the_dataclass():
    with pytest.raises(ValueError, match="unknown target 'spiral'"):
        validate(Flows2DConfig, {"targets": ["spiral"]})


def test_notebook_globals_catch_a_mistyped_injected_parameter():
    namespace = {"In": [], "Out": {}, "torch": pytest, "_hidden": 1, **dataclasses.asdict(Flows2DConfig())}
    assert from_globals(Flows2DConfig, namespace) == Flows2DConfig()
    namespace["lerning_rate"] = 0.1  # what `papermill -p lerning_rate 0.1` injects
    with pytest.raises(ConfigError, match="lerning_rate"):
        from_globals(Flows2DConfig, namespace)


def test_missing_parameter_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        from_yaml(Flows2DConfig, tmp_path / "nope.yaml")


def test_runner_rejects_bad_parameters_before_starting_a_kernel(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train_steps: 10\nbatchsize: 4\n")
    assert main(["00_flows_2d", "--params", str(bad)]) == 2
    assert "batchsize" in capsys.readouterr().err
    assert main(["00_flows_2d", "-p", "train_steps=ten"]) == 2


def test_runner_names_the_run_after_the_params_file():
    params = resolve_parameters("00_flows_2d", str(REPO_ROOT / "params/00_flows_2d/full.yaml"))
    assert params["run_name"] == "full"
    assert resolve_parameters("00_flows_2d", overrides={"seed": 3}, run_name="s3") == {"seed": 3, "run_name": "s3"}


PARAM_FILES = sorted((REPO_ROOT / "params").glob("*/**/*.yaml"))


@pytest.mark.parametrize("path", PARAM_FILES, ids=[str(p.relative_to(REPO_ROOT)) for p in PARAM_FILES])
def test_every_params_file_validates_against_its_notebook(path: Path):
    notebook = path.relative_to(REPO_ROOT / "params").parts[0]
    assert notebook in NOTEBOOK_CONFIGS, f"params/{notebook}/ has no notebook config registered in flowlib.run"
    from_yaml(config_class(notebook), path)
