"""Parameter validation (keys, types, ranges, finiteness, cross-field checks), the notebook runner's checks before
a kernel starts, and every params/ file."""
import dataclasses
import math
import pickle
import re
import typing
from pathlib import Path
from typing import Annotated

import pytest

from flowlib.flows.toy2d import Flows2DConfig
from flowlib.infra.config import ConfigError, from_globals, from_yaml, parse_yaml, validate
from flowlib.infra.runs import REPO_ROOT
from flowlib.methods.registry import METHODS, MethodChoice, method_options
from flowlib.methods.stage3 import Stage3Config, checkpoint_config
from flowlib.rl.loop import RunConfig
from flowlib.policies.bc import ShortCutBCConfig
from flowlib.tools import run
from flowlib.tools.run import NOTEBOOK_CONFIGS, config_class, main, resolve_parameters


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
    assert notebook in NOTEBOOK_CONFIGS, f"params/{notebook}/ has no notebook config registered in flowlib.tools.run"
    from_yaml(config_class(notebook), path)


@pytest.mark.parametrize("path", PARAM_FILES, ids=[str(p.relative_to(REPO_ROOT)) for p in PARAM_FILES])
def test_every_params_file_names_its_own_run_folder(path: Path):
    """So `papermill ... -f params/<nb>/<file>.yaml` (no wrapper) never writes into the default run's folder."""
    from flowlib.infra.config import load_yaml
    from flowlib.tools.run import params_run_name

    assert load_yaml(path).get("run_name") == params_run_name(path) != "default", \
        f"{path}: add `run_name: {params_run_name(path)}`"


@pytest.mark.parametrize("cls, values, message", [
    (Stage3Config, {"num_envs": 0}, "'num_envs' = 0: should be greater than 0 (expected int > 0)"),
    (Stage3Config, {"actor_lr": -3e-5}, "'actor_lr' = -3e-05: should be greater than or equal to 0"),
    (Stage3Config, {"gamma": 1.5}, "'gamma' = 1.5: should be less than or equal to 1 (expected float >= 0, <= 1)"),
    (Stage3Config, {"max_noise_std": float("nan")}, "'max_noise_std' = nan: should be a finite number"),
    (Stage3Config, {"target_kl": float("inf")}, "'target_kl' = inf: should be a finite number"),
    (Stage3Config, {"bench_num_envs": [1, 0]}, "'bench_num_envs'[1] = 0: should be greater than 0"),
    (ShortCutBCConfig, {"batch_size": 0}, "'batch_size' = 0"),
    (Flows2DConfig, {"eval_steps": [1, -2]}, "'eval_steps'[1] = -2"),
])
def test_values_out_of_range_or_not_finite_are_rejected_naming_the_key(cls, values, message):
    with pytest.raises(ConfigError) as err:
        validate(cls, values, source="run.yaml")
    assert str(err.value).startswith(f"run.yaml: bad value for {cls.__name__}: ")
    assert message in str(err.value)


def test_a_config_built_in_code_is_range_checked_too():
    cfg = Stage3Config()
    with pytest.raises(ConfigError, match="'num_envs' = -1: should be greater than 0"):
        dataclasses.replace(cfg, num_envs=-1)
    with pytest.raises(ConfigError, match="'lr' = nan: should be a finite number"):
        ShortCutBCConfig(lr=float("nan"))
    assert dataclasses.replace(cfg, num_threads=0).num_threads == 0  # 0: torch's default, allowed


def test_a_failed_check_across_fields_is_a_config_error_naming_the_source():
    with pytest.raises(ConfigError, match=r"^run.yaml: need min_noise_std \(0.5\) <= final_noise_std"):
        validate(Stage3Config, {"min_noise_std": 0.5}, source="run.yaml")


TD3 = {"steer": "residual_step", "learner": "td3"}
SAC = {"steer": "latent", "learner": "sac"}


@pytest.mark.parametrize("values, message", [
    ({**TD3, "ent_coef": 0.05}, "steer 'residual_step' with learner 'td3' does not read ent_coef (PPOConfig, read by "
                                "steer/learner chain/ppo, latent/ppo, residual/ppo, residual_step/ppo, chain/rfc, gaussian/ppo)"),
    ({**SAC, "clip_coef": 0.3, "target_kl": 0.1}, "does not read clip_coef, target_kl (PPOConfig"),
    ({"td3_n_step": 3}, "steer 'chain' with learner 'ppo' does not read td3_n_step (TD3Config, read by steer/learner "
                        "residual_step/td3)"),
    ({**TD3, "sac_target_kl": 0.2}, "does not read sac_target_kl (SACConfig, read by steer/learner latent/sac)"),
    ({"replay_size": 1000}, "does not read replay_size (ReplayConfig, read by steer/learner latent/sac, "
                            "residual_step/td3, one_step/fql)"),
    ({"latent_bound": 2.0}, "does not read latent_bound (LatentConfig, read by steer/learner latent/ppo, latent/sac)"),
    ({**TD3, "residual_per": "chunk"}, "does not read residual_per (ChunkResidualConfig, read by steer/learner "
                                       "residual/ppo)"),
    ({**TD3, "latent_hidden_dims": [64]}, "does not read latent_hidden_dims (LatentConfig"),
    ({"residual_hidden_dims": [64]}, "does not read residual_hidden_dims (ResidualConfig, read by steer/learner "
                                     "residual/ppo, residual_step/td3, residual_step/ppo)"),
    ({**SAC, "noise_corr": 0.5}, "does not read noise_corr (ChainConfig, read by steer/learner chain/ppo, chain/rfc)"),
    ({**TD3, "log_prob_reduce": "mean"}, "does not read log_prob_reduce (ChunkScoreConfig"),
])
def test_a_field_that_the_method_would_ignore_is_rejected(values, message):
    with pytest.raises(ConfigError, match=re.escape(message) + ".*: leave the key out or choose such a method"):
        validate(Stage3Config, values)


@pytest.mark.parametrize("values", [{"steer": "chain", "learner": "td3"}, {"steer": "residual", "learner": "sac"},
                                    {"steer": "tail", "learner": "ppo"}])
def test_a_steer_and_learner_that_make_no_method_are_one_error_listing_the_methods(values):
    with pytest.raises(ConfigError, match=re.escape(
            f"steer {values['steer']!r} with learner {values['learner']!r} is not a stage-3 method: choose one of "
            "(steer/learner) chain/ppo, latent/ppo, latent/sac, residual/ppo, residual_step/td3, residual_step/ppo")):
        validate(Stage3Config, values)


def test_a_renamed_key_names_its_new_name():
    with pytest.raises(ConfigError, match=re.escape("unknown parameter 'sac_buffer_size' (renamed 'replay_size')")):
        validate(Stage3Config, {**TD3, "sac_buffer_size": 1000})


def test_each_method_takes_its_own_fields_and_the_shared_ones():
    ppo = validate(Stage3Config, {"ent_coef": 0.05, "clip_coef": 0.3, "update_epochs": 8})
    assert (ppo.ent_coef, ppo.clip_coef, ppo.update_epochs) == (0.05, 0.3, 8)
    td3 = validate(Stage3Config, {**TD3, "td3_n_step": 3, "residual_l2": 0.1, "replay_size": 1000, "target_tau": 0.01,
                                  "residual_hidden_dims": [64]})
    assert (td3.learner, td3.td3_n_step, td3.residual_l2, td3.replay_size, td3.residual_hidden_dims) == \
        ("td3", 3, 0.1, 1000, [64])
    sac = validate(Stage3Config, {**SAC, "sac_target_kl": 0.2, "replay_size": 1000, "target_tau": 0.01,
                                  "latent_bound": 2.0, "latent_hidden_dims": [64]})
    assert (sac.learner, sac.sac_target_kl, sac.latent_bound, sac.latent_hidden_dims) == ("sac", 0.2, 2.0, [64])
    chunk = validate(Stage3Config, {"steer": "residual", "residual_per": "chunk", "residual_bound": 0.3})
    assert (chunk.steer, chunk.residual_per, chunk.residual_bound) == ("residual", "chunk", 0.3)
    # a field of another method is refused, naming the method that reads it
    with pytest.raises(ConfigError, match="td3_n_step"):
        validate(Stage3Config, {"ent_coef": 0.05, "td3_n_step": 3})


@pytest.mark.parametrize("pair", list(METHODS), ids="/".join)
def test_a_methods_builders_get_its_own_options_and_nothing_of_another_methods(pair):
    steer, learner = pair
    values = {"steer": steer, "learner": learner, **({"reward": "sparse"} if learner == "fql" else {})}
    cfg = validate(Stage3Config, values)
    options = method_options(cfg)
    own = {f.name for cls in (RunConfig, MethodChoice, *METHODS[pair].configs) for f in dataclasses.fields(cls)}
    assert {f.name for f in dataclasses.fields(options)} == own
    assert all(getattr(options, name) == getattr(cfg, name) for name in own)
    assert pickle.loads(pickle.dumps(options)) == options  # a Ray worker or a spawned process can be handed it
    other = sorted({f.name for f in dataclasses.fields(Stage3Config)} - own)
    assert other, f"{pair} reads every group"
    with pytest.raises(AttributeError):  # an option of another method is not there to be read by mistake
        getattr(options, other[0])


def test_a_checkpoints_config_drops_what_its_method_ignores_but_an_override_may_not_set_it():
    ran = dataclasses.asdict(Stage3Config(**SAC, replay_batch_size=4))
    older = {**ran, "ent_coef": 0.05}  # a run from before the check, where PPO's field did nothing
    assert checkpoint_config({"config": older}).ent_coef == Stage3Config().ent_coef
    as_ppo = checkpoint_config({"config": ran}, {"learner": "ppo"})  # the same weights, another learner
    assert as_ppo.learner == "ppo" and as_ppo.replay_batch_size == Stage3Config().replay_batch_size
    with pytest.raises(ConfigError, match="with learner 'ppo' does not read target_tau"):
        checkpoint_config({"config": ran}, {"learner": "ppo", "target_tau": 0.01})


def test_a_checkpoints_config_reads_old_names_as_the_new_ones():
    ran = {k: v for k, v in dataclasses.asdict(Stage3Config(**TD3)).items()
           if k not in ("replay_size", "residual_hidden_dims")}
    old = {**ran, "sac_buffer_size": 5000, "latent_hidden_dims": [32]}  # as runs before the split wrote them
    cfg = checkpoint_config({"config": old})
    assert cfg.replay_size == 5000 and cfg.residual_hidden_dims == [32]


@pytest.mark.parametrize("argv, message", [
    (["03_reinflow", "-p", "max_noise_std=.nan"], "'max_noise_std' = nan: should be a finite number"),
    (["03_reinflow", "-p", "min_noise_std=0.5"], "need min_noise_std (0.5) <= final_noise_std"),
    (["03_reinflow", "--run-name", "../elsewhere"], "run_name must be a plain folder name"),
    (["02_aw_shortcut"], "stage1_checkpoint: checkpoint"),
    (["03_reinflow", "-p", "init_checkpoint=01_shortcut_bc/nope/best_model.pt"], "init_checkpoint: checkpoint"),
    (["04_flow_sde", "-p", "init_checkpoint=01_shortcut_bc/nope/best_model.pt"], "init_checkpoint: checkpoint"),
    (["06_steering", "--params", str(REPO_ROOT / "params/06_steering/cpu.yaml")],  # the run that writes its start
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


def _write(path: Path, content) -> str:
    import torch

    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    return str(path)


@pytest.mark.parametrize("notebook, key", [("02_aw_shortcut", "stage1_checkpoint"), ("03_reinflow", "init_checkpoint"),
                                           ("06_steering", "init_checkpoint"), ("04_flow_sde", "init_checkpoint")])
@pytest.mark.parametrize("content, message", [
    (b"\x9a not a torch file", "is not a readable torch checkpoint"),
    ({"weights": [1, 2]}, "is not a flowlib flow-policy checkpoint"),
])
def test_a_corrupted_or_foreign_start_checkpoint_is_one_error_before_a_kernel(notebook, key, content, message,
                                                                              tmp_path, capsys):
    path = _write(tmp_path / "start.pt", content)
    assert main([notebook, "-p", f"{key}={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}: {path}") and message in err and err.count("\n") == 1


def test_a_start_checkpoint_of_another_task_names_both_tasks(capsys):
    start = str(REPO_ROOT / "tests/fixtures/checkpoints/stage1.pt")
    assert main(["03_reinflow", "-p", f"init_checkpoint={start}", "-p", "env_id=FastReach-v0"]) == 2
    err = capsys.readouterr().err
    assert "is a policy for PickCube-v1, this run is for FastReach-v0" in err and "set env_id: PickCube-v1" in err


@pytest.mark.parametrize("argv, message", [
    (["01_shortcut_bc", "-p", "down_dims=[32, 64"], "-p down_dims=[32, 64 is not valid YAML (line 1, column 8)"),
    (["00_flows_2d", "-p", "methods=[shortcut]"], "lacks 'reflow', the multi-step baseline"),
    (["00_flows_2d", "-p", "methods=[reflow, reflow]"], "must not repeat a name"),
    (["03_reinflow", "-p", "actor_lerning_rate=1e-4"], "(did you mean 'actor_lr'?)"),
    (["06_steering", "-p", "critic_lerning_rate=1e-4"], "(did you mean 'critic_lr'?)"),
])
def test_bad_overrides_are_one_line_errors_naming_the_key(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_params_file_that_is_not_yaml_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train_steps: 10\ntargets: [two_moons\nseed: 1\n")
    assert main(["00_flows_2d", "--params", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"parameter file {bad} is not valid YAML (line 3" in err and err.count("\n") == 1


def test_a_list_that_arrives_as_text_says_how_to_pass_a_list():
    with pytest.raises(ConfigError) as err:
        validate(Flows2DConfig, {"targets": "[two_moons, rings]"})  # what `papermill -p targets '[...]'` injects
    assert "-y 'targets: [two_moons, rings]' for papermill" in str(err.value)


def test_the_chain_ppo_tutorial_may_start_without_its_start_checkpoint_which_it_makes(tmp_path, monkeypatch):
    """Notebook 03's default start is written by a params file of notebook 01, which the notebook runs when the
    checkpoint is missing (flowlib.tools.run.ensure_checkpoint); a start no params file writes still stops the run."""
    from flowlib.infra.runs import checkpoint_location, run_that_writes
    from flowlib.tools.run import ensure_checkpoint, preflight

    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    assert preflight("03_reinflow", resolve_parameters("03_reinflow")) == ""
    start = checkpoint_location(Stage3Config.__dataclass_fields__["init_checkpoint"].default or "")
    assert run_that_writes(start) == ("01_shortcut_bc", None)  # Stage3Config's start: notebook 01's defaults
    tutorial = checkpoint_location(config_class("03_reinflow")().init_checkpoint)
    assert run_that_writes(tutorial) == ("01_shortcut_bc", Path("params/01_shortcut_bc/fast_reach_mlp.yaml"))
    missing = resolve_parameters("03_reinflow", overrides={"init_checkpoint": "01_shortcut_bc/nope/best_model.pt"})
    assert "run notebook 01 first" in preflight("03_reinflow", missing)
    named = resolve_parameters("03_reinflow", overrides={"init_checkpoint": "01_shortcut_bc/fast_push_mlp/best_model.pt"})
    assert "run notebook 01 first" in preflight("03_reinflow", named)  # only the default start is made
    with pytest.raises(FileNotFoundError, match="no params file of notebook 01 or 02 writes it"):
        ensure_checkpoint(tmp_path / "elsewhere" / "best_model.pt")
    assert preflight("02_aw_shortcut", resolve_parameters("02_aw_shortcut")).startswith("stage1_checkpoint: ")


# --------------------------------------------------------------------------- every bad number, before a kernel


def _bounds(hint) -> tuple[float, bool, float]:
    """(lower bound, whether it is strict, upper bound) of an annotated number's range (-inf, False, inf: none)."""
    lo, strict, hi = -math.inf, False, math.inf
    for m in typing.get_args(hint)[1:]:
        for c in getattr(m, "metadata", [m]):
            lo, strict = (c.gt, True) if hasattr(c, "gt") else (c.ge, False) if hasattr(c, "ge") else (lo, strict)
            hi = c.le if hasattr(c, "le") else hi
    return lo, strict, hi


def _numbers(cls):
    """Each int / float field of ``cls`` (and each list of them) with the type of its items and its range."""
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else hint
        base = typing.get_args(item)[0] if typing.get_origin(item) is Annotated else item
        if base in (int, float):
            yield name, hint, item, base


def test_every_notebook_number_field_has_a_range_its_subclasses_keep():
    """A notebook's config that sets its own defaults redeclares fields: it must keep the base's range (notebook 03's
    num_envs: int once let -2 reach the kernel)."""
    loose = [f"{nb}.{name}" for nb in NOTEBOOK_CONFIGS for name, _, item, _ in _numbers(config_class(nb))
             if typing.get_origin(item) is not Annotated]
    assert not loose, f"give these fields a range (PositiveInt, NonNegativeFloat, Fraction...): {loose}"


@pytest.mark.parametrize("notebook", sorted(NOTEBOOK_CONFIGS))
def test_every_bad_number_stops_with_one_error_line_before_a_kernel_or_a_run_folder(notebook, monkeypatch, capsys):
    """A negative, a zero where zero is out of range, a value past the upper bound and a NaN, for every number field:
    ``python -m flowlib.run`` prints one ``error:`` line naming the field and returns 2, with no kernel started and no
    run folder made."""
    def never(*args, **kwargs):
        raise AssertionError("a bad value reached the kernel or made a run folder")

    monkeypatch.setattr(run, "execute", never)
    monkeypatch.setattr(run, "run_dir", never)
    tried = 0
    for name, hint, item, base in _numbers(config_class(notebook)):
        lo, strict, hi = _bounds(item)
        bad = [v for v in (-1, 0, hi + 1 if hi < math.inf else None) if v is not None and (v < lo or (strict and v == lo) or v > hi)]
        bad += [".nan"] if base is float else []
        for value in bad:
            text = f"[{value}]" if typing.get_origin(hint) is list else str(value)
            assert run.main([notebook, "-p", f"{name}={text}"]) == 2, f"{notebook}: {name}={text} was accepted"
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("error:") and name in err[0], (name, text, err)
            tried += 1
    assert tried, f"{notebook}: no number field to walk"
