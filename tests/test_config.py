"""Parameter validation (keys, types, ranges, finiteness, cross-field checks), the notebook runner's checks before
a kernel starts, and every params/ file."""
import dataclasses
import re
from pathlib import Path

import pytest

from flowlib.config import ConfigError, from_globals, from_yaml, parse_yaml, validate
from flowlib.run import NOTEBOOK_CONFIGS, config_class, main, resolve_parameters
from flowlib.bc import ShortCutBCConfig
from flowlib.reinflow import ReinFlowConfig
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


@pytest.mark.parametrize("cls, values, message", [
    (ReinFlowConfig, {"num_envs": 0}, "'num_envs' = 0: should be greater than 0 (expected int > 0)"),
    (ReinFlowConfig, {"actor_lr": -3e-5}, "'actor_lr' = -3e-05: should be greater than 0"),
    (ReinFlowConfig, {"gamma": 1.5}, "'gamma' = 1.5: should be less than or equal to 1 (expected float >= 0, <= 1)"),
    (ReinFlowConfig, {"max_noise_std": float("nan")}, "'max_noise_std' = nan: should be a finite number"),
    (ReinFlowConfig, {"target_kl": float("inf")}, "'target_kl' = inf: should be a finite number"),
    (ReinFlowConfig, {"bench_num_envs": [1, 0]}, "'bench_num_envs'[1] = 0: should be greater than 0"),
    (ShortCutBCConfig, {"batch_size": 0}, "'batch_size' = 0"),
    (Flows2DConfig, {"eval_steps": [1, -2]}, "'eval_steps'[1] = -2"),
])
def test_values_out_of_range_or_not_finite_are_rejected_naming_the_key(cls, values, message):
    with pytest.raises(ConfigError) as err:
        validate(cls, values, source="run.yaml")
    assert str(err.value).startswith(f"run.yaml: bad value for {cls.__name__}: ")
    assert message in str(err.value)


def test_a_config_built_in_code_is_range_checked_too():
    cfg = ReinFlowConfig()
    with pytest.raises(ConfigError, match="'num_envs' = -1: should be greater than 0"):
        dataclasses.replace(cfg, num_envs=-1)
    with pytest.raises(ConfigError, match="'lr' = nan: should be a finite number"):
        ShortCutBCConfig(lr=float("nan"))
    assert dataclasses.replace(cfg, num_threads=0).num_threads == 0  # 0: torch's default, allowed


def test_a_failed_check_across_fields_is_a_config_error_naming_the_source():
    with pytest.raises(ConfigError, match=r"^run.yaml: need min_noise_std \(0.5\) <= final_noise_std"):
        validate(ReinFlowConfig, {"min_noise_std": 0.5}, source="run.yaml")


TD3 = {"steer": "residual_step", "learner": "td3"}
SAC = {"steer": "latent", "learner": "sac"}


@pytest.mark.parametrize("values, message", [
    ({**TD3, "ent_coef": 0.05}, "learner 'td3' ignores ent_coef (read only by learner 'ppo')"),
    ({**SAC, "clip_coef": 0.3, "target_kl": 0.1},
     "learner 'sac' ignores clip_coef, target_kl (read only by learner 'ppo')"),
    ({"td3_n_step": 3}, "learner 'ppo' ignores td3_n_step (read only by learner 'td3')"),
    ({**TD3, "sac_target_kl": 0.2}, "learner 'td3' ignores sac_target_kl (read only by learner 'sac')"),
    ({"sac_buffer_size": 1000}, "learner 'ppo' ignores sac_buffer_size (read only by learner 'sac' / 'td3')"),
    ({"latent_bound": 2.0}, "steer 'chain' ignores latent_bound (read only by steer 'latent')"),
    ({**TD3, "residual_per": "chunk"}, "steer 'residual_step' ignores residual_per (read only by steer 'residual')"),
    ({"latent_hidden_dims": [64]}, "steer 'chain' ignores latent_hidden_dims (read only by steer 'latent' / "
                                   "'residual' / 'residual_step')"),
])
def test_a_field_that_the_learner_or_steer_would_ignore_is_rejected(values, message):
    with pytest.raises(ConfigError, match=re.escape(message) + ": leave the key out or set (learner|steer)"):
        validate(ReinFlowConfig, values)


def test_each_learner_and_steer_takes_its_own_fields_and_the_shared_ones():
    validate(ReinFlowConfig, {"ent_coef": 0.05, "clip_coef": 0.3, "update_epochs": 8})
    validate(ReinFlowConfig, {**TD3, "td3_n_step": 3, "residual_l2": 0.1, "sac_buffer_size": 1000, "sac_tau": 0.01})
    validate(ReinFlowConfig, {**SAC, "sac_target_kl": 0.2, "sac_buffer_size": 1000, "sac_tau": 0.01,
                              "latent_bound": 2.0, "latent_hidden_dims": [64]})
    validate(ReinFlowConfig, {"steer": "residual", "residual_per": "chunk", "residual_bound": 0.3})


def test_a_checkpoints_config_drops_what_its_learner_ignores_but_an_override_may_not_set_it():
    from flowlib.reinflow import checkpoint_config

    ran = dataclasses.asdict(ReinFlowConfig(**SAC, sac_batch_size=4))
    older = {**ran, "ent_coef": 0.05}  # a run from before the check, where PPO's field did nothing
    assert checkpoint_config({"config": older}).ent_coef == ReinFlowConfig().ent_coef
    as_ppo = checkpoint_config({"config": ran}, {"learner": "ppo"})  # the same weights, another learner
    assert as_ppo.learner == "ppo" and as_ppo.sac_batch_size == ReinFlowConfig().sac_batch_size
    with pytest.raises(ConfigError, match="learner 'ppo' ignores sac_tau"):
        checkpoint_config({"config": ran}, {"learner": "ppo", "sac_tau": 0.01})


@pytest.mark.parametrize("argv, message", [
    (["03_reinflow", "-p", "max_noise_std=.nan"], "'max_noise_std' = nan: should be a finite number"),
    (["03_reinflow", "-p", "min_noise_std=0.5"], "need min_noise_std (0.5) <= final_noise_std"),
    (["03_reinflow", "--run-name", "../elsewhere"], "run_name must be a plain folder name"),
    (["02_aw_shortcut"], "stage1_checkpoint: checkpoint"),
    (["03_reinflow"], "init_checkpoint: checkpoint"),
    (["04_flow_sde"], "init_checkpoint: checkpoint"),
    (["03_reinflow", "--params", str(REPO_ROOT / "params/03_reinflow/cpu.yaml")],  # the run that writes its start
     "cpu150/best_model.pt not found: run notebook 01 first (python -m flowlib.run 01_shortcut_bc --params "
     "params/01_shortcut_bc/cpu150.yaml)"),
    (["03_reinflow", "--params", str(REPO_ROOT / "params/03_reinflow/baseline.yaml")],
     "run notebook 02 first (python -m flowlib.run 02_aw_shortcut --params params/02_aw_shortcut/gpu.yaml)"),
])
def test_runner_stops_on_bad_values_and_missing_start_checkpoints_before_a_kernel(argv, message, tmp_path,
                                                                                  monkeypatch, capsys):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))  # no stage-1 checkpoint here
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    if message.endswith("checkpoint: checkpoint"):  # the default start: notebook 01's default run
        assert "run notebook 01 first (python -m flowlib.run 01_shortcut_bc) or set" in err
    assert list(tmp_path.iterdir()) == []  # no run folder was made
