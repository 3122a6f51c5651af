"""The ReinFlow ablation sweep: 22 valid parameter files, a dry-run plan, resumability, failures
recorded without stopping the others, and the monitor."""
from pathlib import Path

import pytest

from flowlib.infra.config import ConfigError, load_yaml
from flowlib.infra.runs import REPO_ROOT
from flowlib.tools import sweep, sweep_report

ABLATIONS = REPO_ROOT / "params" / "03_reinflow" / "ablations"


def test_the_ablation_folder_holds_the_baseline_and_21_variants():
    files = sorted(ABLATIONS.glob("*.yaml"))
    assert len(files) == 22
    def setting(path):  # the run's parameters, less the folder it names
        return {k: v for k, v in load_yaml(path).items() if k != "run_name"}
    base = setting(ABLATIONS / "baseline.yaml")
    assert base == setting(REPO_ROOT / "params" / "03_reinflow" / "baseline.yaml")
    for f in files:
        if f.stem != "baseline":
            changed = {k for k, v in setting(f).items() if base.get(k) != v}
            assert changed, f"{f.name} is identical to the baseline"


def test_dry_run_lists_22_x_seeds_jobs_and_skips_finished_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    jobs = sweep.plan("03_reinflow", ABLATIONS, [0, 1, 2])
    assert len(jobs) == 66 and len({j.run_name for j in jobs}) == 66
    done = jobs[5]
    Path(done.out_dir).mkdir(parents=True)
    (Path(done.out_dir) / "summary.json").write_text("{}")
    out = sweep.run_sweep("03_reinflow", ABLATIONS, [0, 1, 2], dry_run=True)
    assert out == {"jobs": 66, "todo": 65, "ran": []}
    printed = capsys.readouterr().out
    assert f"skip  {done.name}" in printed and "65 to run" in printed
    assert not (tmp_path / "03_reinflow" / "ablations" / "sweep.json").exists()  # a dry run writes nothing


def test_a_bad_parameter_file_stops_the_plan_before_anything_runs(tmp_path):
    (tmp_path / "ok.yaml").write_text("ent_coef: 0.02\n")
    (tmp_path / "typo.yaml").write_text("ent_coeff: 0.02\n")
    with pytest.raises(ConfigError, match="ent_coeff.*did you mean 'ent_coef'"):
        sweep.plan("03_reinflow", tmp_path, [0])
    with pytest.raises(ConfigError, match="no \\*.yaml"):
        sweep.plan("03_reinflow", tmp_path / "empty", [0])


@pytest.mark.slow
def test_a_failing_job_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "out"))
    params = tmp_path / "params"
    params.mkdir()
    # both runs fail fast and for real (no stage-1 checkpoint in this outputs root): each is recorded
    (params / "a.yaml").write_text("init_checkpoint: missing/best_model.pt\n")
    (params / "b.yaml").write_text("init_checkpoint: also_missing/best_model.pt\n")
    out = sweep.run_sweep("03_reinflow", params, [0], max_jobs=1)
    assert [r["status"] for r in out["ran"]] == ["failed", "failed"]
    for name in ("a_seed0", "b_seed0"):
        error = (tmp_path / "out" / "03_reinflow" / "params" / name / "error.txt").read_text()
        assert "not found" in error and "run notebook 01" in error
    rows = sweep.monitor(tmp_path / "out" / "03_reinflow" / "params")
    assert [r["status"] for r in rows] == ["failed", "failed"]
    with pytest.raises(ValueError, match="no finished job yet; 2 failed, a_seed0 with: error: init_checkpoint: .*not found"):
        sweep_report.load_sweep(tmp_path / "out" / "03_reinflow" / "params")  # the report says why, not only "see monitor"
    with pytest.raises(FileNotFoundError, match="sweep folder"):
        sweep.monitor(tmp_path)


def test_overrides_reach_every_job_but_may_not_erase_an_ablation(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    cpu = {"init_checkpoint": "01_shortcut_bc/cpu100/best_model.pt", "num_envs": 4, "bench_num_envs": [4]}
    jobs = sweep.plan("03_reinflow", ABLATIONS, [0, 1], "ablations_cpu", cpu)
    assert len(jobs) == 44 and all(j.overrides == cpu for j in jobs)
    cmd = jobs[0].command("03_reinflow")
    sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-p"]
    assert sets == ['init_checkpoint="01_shortcut_bc/cpu100/best_model.pt"', "num_envs=4", "bench_num_envs=[4]",
                    "seed=0"]
    from flowlib.tools.run import parse_overrides
    assert parse_overrides(sets) == {**cpu, "seed": 0}  # what the job's flowlib.tools.run reads back
    with pytest.raises(ConfigError, match="num_inference_steps \\(varied by steps_K16.yaml\\)"):
        sweep.plan("03_reinflow", ABLATIONS, [0], overrides={"num_inference_steps": 4})
    with pytest.raises(ConfigError, match="use --seeds"):
        sweep.plan("03_reinflow", ABLATIONS, [0], overrides={"seed": 3})
    with pytest.raises(ConfigError, match="num_env"):
        sweep.plan("03_reinflow", ABLATIONS, [0], overrides={"num_env": 4})


def test_summarize_reports_steps_to_level_gain_stability_and_cost_per_setting():
    import numpy as np
    import pandas as pd

    def curve(job, variant, successes):
        return [{"job": job, "variant": variant, "step": 100 * (i + 1), "train/success_once": v,
                 "rollout_time": 2.0, "update_time": 1.0} for i, v in enumerate(successes)]

    curves = pd.DataFrame(curve("a0", "noise_exp", [0.2, 0.5, 0.9, 0.7]) + curve("a1", "noise_exp", [0.9, 0.9, 0.9, 0.9])
                          + curve("b0", "baseline", [0.1, 0.2, 0.3, 0.4]))
    finals = pd.DataFrame([{"job": "a0", "variant": "noise_exp", "category": "noise", "seed": 0, "before": 0.5, "after": 0.7},
                           {"job": "a1", "variant": "noise_exp", "category": "noise", "seed": 1, "before": 0.5, "after": 0.9},
                           {"job": "b0", "variant": "baseline", "category": "baseline", "seed": 0, "before": 0.5, "after": 0.4}])
    t = sweep_report.summarize(curves, finals, level=0.9).set_index("variant")
    assert t.loc["noise_exp", "steps_to_0.9"] == 200.0 and t.loc["noise_exp", "seeds_reaching"] == 2  # 300 and 100
    assert np.isnan(t.loc["baseline", "steps_to_0.9"]) and t.loc["baseline", "seeds_reaching"] == 0
    assert t.loc["noise_exp", "final_success_mean"] == pytest.approx(0.8)
    assert t.loc["noise_exp", "final_success_std"] == pytest.approx(0.1)
    assert t.loc["noise_exp", "gain_mean"] == pytest.approx(0.3) and t.loc["baseline", "gain_mean"] == pytest.approx(-0.1)
    # stability: std of the second half, [0.9, 0.7] and [0.9, 0.9], averaged over seeds
    assert t.loc["noise_exp", "stability_std"] == pytest.approx(np.std([0.9, 0.7], ddof=1) / 2)
    assert t.loc["noise_exp", "s_per_iteration"] == pytest.approx(3.0)


def test_a_job_the_start_checkpoint_cannot_run_is_known_at_plan_time_and_never_started(tmp_path, monkeypatch, capsys):
    """K = 16 from a ShortCut trained for 8 steps: the dry run says so, the sweep records it without starting it,
    and flowlib.tools.run refuses it before a kernel starts."""
    from test_reinflow import tiny_policy

    from flowlib.policies import bc
    from flowlib.tools import run

    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "out"))
    start = tmp_path / "out" / "01_shortcut_bc" / "s1" / "best_model.pt"
    policy, _ = tiny_policy()
    bc.save_checkpoint(start, policy, None, None, 0, bc.ShortCutBCConfig(env_id="PickCube-v1", velocity_net="unet", down_dims=[8, 16], emb_dim=8), {})
    params = tmp_path / "params"
    params.mkdir()
    (params / "steps_K16.yaml").write_text("env_id: PickCube-v1\nnum_inference_steps: 16\n")
    (params / "steps_K4.yaml").write_text("env_id: PickCube-v1\nnum_inference_steps: 4\n")
    jobs = sweep.plan("03_reinflow", params, [0], overrides={"init_checkpoint": "01_shortcut_bc/s1/best_model.pt"})
    assert [bool(j.problem) for j in jobs] == [True, False]
    assert "at most 8 steps" in jobs[0].problem and "shortcut_max_steps >= 16" in jobs[0].problem
    sweep.run_sweep("03_reinflow", params, [0], dry_run=True, overrides={"init_checkpoint": "01_shortcut_bc/s1/best_model.pt"})
    printed = capsys.readouterr().out
    assert "fail  steps_K16_seed0" in printed and "run   steps_K4_seed0" in printed and "1 of them cannot start" in printed
    # a missing start is not judged at plan time (stage 1 may not have run yet)
    assert not sweep.plan("03_reinflow", params, [0], overrides={"init_checkpoint": "later/best_model.pt"})[0].problem
    (params / "steps_K4.yaml").unlink()  # it would start a real run
    out = sweep.run_sweep("03_reinflow", params, [0], overrides={"init_checkpoint": "01_shortcut_bc/s1/best_model.pt"})
    assert [r["status"] for r in out["ran"]] == ["failed"]
    job_dir = tmp_path / "out" / "03_reinflow" / "params" / "steps_K16_seed0"
    assert "not started: num_inference_steps = 16" in (job_dir / "error.txt").read_text()
    assert not (job_dir / "job.log").exists()
    assert sweep.monitor(job_dir.parent)[0]["status"] == "failed"
    assert run.main(["03_reinflow", "--params", str(params / "steps_K16.yaml"),
                     "-p", "init_checkpoint=01_shortcut_bc/s1/best_model.pt"]) == 2
    assert "at most 8 steps" in capsys.readouterr().err
