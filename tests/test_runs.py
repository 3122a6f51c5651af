"""Run folders, atomic writes and metric tracking (W&B offline needs no account or network)."""
import csv
import json

import pytest
import torch

from flowlib.infra.runs import rng_state, run_dir, save_json, save_torch, set_rng_state
from flowlib.infra.tracking import Tracker


def test_rng_state_rewinds_the_draws_and_reads_checkpoints_saved_without_cuda_state():
    state = rng_state()
    draws = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), draws)
    set_rng_state({"rng": state["rng"]})  # a checkpoint from before CUDA's state was saved: the CPU's alone
    assert torch.equal(torch.rand(3), draws)
    if torch.cuda.is_available():  # a GPU machine: a GPU run's noise is drawn there, and rewinds too
        state = rng_state()
        draws = torch.rand(3, device="cuda")
        set_rng_state(state)
        assert torch.equal(torch.rand(3, device="cuda"), draws)


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_torch({"step": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_torch({"step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary left behind


def test_run_dir_lives_under_the_outputs_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    assert run_dir("00_flows_2d", "r1") == tmp_path / "00_flows_2d" / "r1"
    assert run_dir("03_reinflow", "sweep/job_seed0") == tmp_path / "03_reinflow" / "sweep" / "job_seed0"
    for bad in ("../escape", "a/b/c", "sweep/", ".hidden"):
        with pytest.raises(ValueError, match="plain folder name"):
            run_dir("00_flows_2d", bad)


def test_tracker_writes_jsonl_csv_and_summary_and_resumes(tmp_path):
    tr = Tracker(tmp_path)
    tr.log({"loss": torch.tensor(0.5)}, step=0)
    tr.log({"loss": 0.25, "acc": 1.0}, step=10)
    tr.summary({"final": 0.25})
    tr.finish()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["loss"] for r in rows] == ["0.5", "0.25"] and rows[1]["acc"] == "1.0"
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final": 0.25}
    resumed = Tracker(tmp_path, resume=True)
    resumed.log({"loss": 0.1}, step=20)
    assert [r["step"] for r in resumed.rows] == [0, 10, 20]


def test_wandb_offline_writes_locally(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tr = Tracker(tmp_path, config={"lr": 1e-3}, wandb_mode="offline", project="flowlib-test")
    tr.log({"loss": 1.0}, step=0)
    tr.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline W&B run written"


def test_tracker_rejects_unknown_wandb_mode(tmp_path):
    with pytest.raises(ValueError, match="wandb_mode"):
        Tracker(tmp_path, wandb_mode="cloud")


def test_save_json_handles_tensors(tmp_path):
    save_json(tmp_path / "m.json", {"x": torch.tensor(1.5), "v": torch.arange(2)})
    assert json.loads((tmp_path / "m.json").read_text()) == {"x": 1.5, "v": [0, 1]}


def test_tracker_rewind_drops_rows_a_resumed_run_will_log_again(tmp_path):
    tracker = Tracker(tmp_path)
    for step in (10, 20, 30):
        tracker.log({"loss": 1.0 / step}, step)
    resumed = Tracker(tmp_path, resume=True)
    resumed.rewind(20)
    resumed.log({"loss": 0.0}, 30)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20, 30] and [r["step"] for r in resumed.rows] == [10, 20, 30]


def test_a_resumed_run_keeps_its_wall_clock(tmp_path):
    """wall_time goes on from the last kept row, so a curve against wall time has no jump back to 0."""
    rows = [{"step": s, "wall_time": w} for s, w in ((10, 100.0), (20, 200.0), (30, 300.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    resumed = Tracker(tmp_path, resume=True)
    resumed.rewind(20)                                   # the checkpoint was at step 20
    resumed.log({"loss": 0.0}, 30)
    assert 200.0 <= resumed.rows[-1]["wall_time"] < 210.0
    fresh = Tracker(tmp_path)                            # not resumed: a new clock
    fresh.log({"loss": 0.0}, 10)
    assert fresh.rows[-1]["wall_time"] < 10.0


class _FakeWandbRun:
    """W&B's rule for a run's rows: a row whose ``step`` is below the last one is dropped (with a warning)."""

    def __init__(self):
        self.rows, self._step = [], -1

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, row, step=None):
        step = self._step + 1 if step is None else step
        if step >= self._step:
            self.rows.append(row)
            self._step = step

    def finish(self):
        pass


def test_wandb_keeps_every_row_when_the_step_starts_again(tmp_path, monkeypatch):
    import sys
    import types

    run = _FakeWandbRun()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: run))
    tr = Tracker(tmp_path, wandb_mode="offline")
    for curve in ("two_moons/reflow", "two_moons/shortcut"):  # notebook 00: a curve per target and method
        for step in (0, 100, 200):
            tr.log({f"{curve}/loss": 1.0 / (step + 1)}, step)
    tr.finish()
    assert [r["step"] for r in run.rows] == [0, 100, 200, 0, 100, 200]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_get_the_mode_the_umask_gives(tmp_path, umask):
    import os

    old = os.umask(umask)
    try:
        paths = [save_json(tmp_path / "summary.json", {"a": 1}), save_torch({"w": torch.zeros(1)}, tmp_path / "last.pt")]
        plain = tmp_path / "plain.txt"
        plain.write_text("x")  # what open() gives, as for metrics.jsonl
    finally:
        os.umask(old)
    for path in paths:
        assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_figure_with_an_unlabelled_scale_is_refused_naming_the_axes(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flowlib.infra.runs import save_figure

    fig, (a, b) = plt.subplots(1, 2, sharey=True)
    a.plot([0, 1], [1, 2]), b.plot([0, 1], [2, 3])
    a.set_title("loss"), b.set_title("success")
    a.set_xlabel("step"), a.set_ylabel("value")
    with pytest.raises(ValueError, match="figure 'curves': 'success' has no x label"):
        save_figure(fig, tmp_path, "curves")
    b.set_xlabel("step")  # b's y label is a's: they share y
    assert save_figure(fig, tmp_path, "curves").exists()
    plt.close(fig)


def test_a_figure_without_a_title_is_refused(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flowlib.infra.runs import save_figure

    fig, (a, b) = plt.subplots(1, 2)
    for ax in (a, b):
        ax.plot([0, 1], [1, 2]), ax.set_xlabel("step"), ax.set_ylabel("loss")
    a.set_title("left")
    with pytest.raises(ValueError, match=r"figure 'untitled': axes \[1\] have no title and the figure no suptitle"):
        save_figure(fig, tmp_path, "untitled")
    fig.suptitle("both panels")  # a figure title covers its panels
    assert save_figure(fig, tmp_path, "untitled").exists()
    plt.close(fig)


def test_bars_and_lines_that_are_all_zero_say_so(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flowlib.infra.runs import save_figure

    fig, (a, b) = plt.subplots(1, 2)
    a.bar(["K=1", "K=4"], [0.0, 0.0]), b.plot([0, 10], [0.0, 0.0])
    for ax in (a, b):
        ax.set_xlabel("x"), ax.set_ylabel("success")
    fig.suptitle("zeros")
    save_figure(fig, tmp_path, "zeros")
    assert [t.get_text() for t in a.texts] == ["0.00", "0.00"]
    assert [t.get_text() for t in b.texts] == ["all values are 0"]
    plt.close(fig)


# --------------------------------------------------------------------------- lab and batch runs apart


def test_a_lab_run_left_at_default_writes_and_starts_from_the_labs_own_folders(tmp_path, monkeypatch):
    """In the JupyterLab of ``make lab`` (FLOWLIB_RUN_KIND=lab) a run that names no folder writes outputs/<nb>/lab,
    and its default start is notebook 01's lab run: ``make demo``'s ``default`` folders are never touched."""
    from flowlib.infra.runs import checkpoint_location, run_that_writes
    from flowlib.infra.tracking import start_run
    from flowlib.policies.bc import ShortCutBCConfig

    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    monkeypatch.setenv("FLOWLIB_RUN_KIND", "lab")
    cfg = ShortCutBCConfig()
    run_path, tracker = start_run("01_shortcut_bc", cfg)
    tracker.finish()
    assert run_path == tmp_path / "01_shortcut_bc" / "lab" and cfg.run_name == "lab"
    assert (run_path / "run_kind").read_text() == "lab\n" and "run_name: lab" in (run_path / "params.yaml").read_text()
    assert checkpoint_location("") == tmp_path / "01_shortcut_bc" / "lab" / "best_model.pt"
    assert run_that_writes(checkpoint_location("")) == ("01_shortcut_bc", None)
    monkeypatch.delenv("FLOWLIB_RUN_KIND")
    assert checkpoint_location("") == tmp_path / "01_shortcut_bc" / "default" / "best_model.pt"
    assert not (tmp_path / "01_shortcut_bc" / "default").exists()


def test_resuming_a_folder_another_kind_of_run_made_says_so(tmp_path, monkeypatch, capsys):
    from flowlib.infra.tracking import start_run
    from flowlib.methods.stage3 import SteeringConfig

    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    run_path, tracker = start_run("06_steering", SteeringConfig(run_name="cpu"))  # a batch run
    tracker.finish()
    (run_path / "last.pt").write_bytes(b"")
    monkeypatch.setenv("FLOWLIB_RUN_KIND", "lab")
    capsys.readouterr()
    _, tracker = start_run("06_steering", SteeringConfig(run_name="cpu"))
    tracker.finish()
    out = capsys.readouterr().out
    assert "was made by a batch run; this lab run resumes it" in out and "resume: False" in out
    (run_path / "run_kind").write_text("batch\n")
    _, tracker = start_run("06_steering", SteeringConfig(run_name="cpu", resume=False))  # starts apart: no note
    tracker.finish()
    assert "was made by" not in capsys.readouterr().out
