"""The sweep's Ray backend, exercised: a local Ray head on localhost (``ray start --head``, as on a cluster's head
node), a two-job sweep of notebook 00 through it with one job failing on purpose, both recorded, Ray shut down."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray  # the ray extra, which make install installs: pip install -e '.[ray]'

from flowlib.tools import sweep

TINY = "targets: [two_moons]\nmethods: [reflow]\ntrain_steps: 30\nhidden: 16\ndepth: 2\neval_steps: [1]\neval_samples: 200\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_two_job_sweep_runs_through_a_local_ray_head_and_records_the_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path / "out"))
    params = tmp_path / "tiny"
    params.mkdir()
    (params / "ok.yaml").write_text(TINY)
    (params / "diverges.yaml").write_text(TINY + "lr: 1.0e+30\n")  # valid parameters; the run itself fails
    ray_cli = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
    port = free_port()
    # the workers get the head's environment, not this test's: the sweep passes FLOWLIB_OUTPUTS with each job
    subprocess.run([*ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
                    "--include-dashboard=false", "--disable-usage-stats", "--object-store-memory=100000000"],
                   check=True, capture_output=True, env={k: v for k, v in os.environ.items() if k != "FLOWLIB_OUTPUTS"})
    try:
        out = sweep.run_sweep("00_flows_2d", params, [0], backend="ray", ray_address=f"127.0.0.1:{port}")
    finally:
        ray.shutdown()
        subprocess.run([*ray_cli, "stop", "--force"], capture_output=True)
    assert {r["job"]: r["status"] for r in out["ran"]} == {"diverges_seed0": "failed", "ok_seed0": "done"}
    sweep_dir = tmp_path / "out" / "00_flows_2d" / "tiny"
    error = (sweep_dir / "diverges_seed0" / "error.txt").read_text()
    assert "ReFlow loss is" in error and "lower lr" in error
    summary = json.loads((sweep_dir / "ok_seed0" / "summary.json").read_text())
    assert "sliced_wasserstein" in summary
    assert {r["job"]: r["status"] for r in sweep.monitor(sweep_dir)} == {"diverges_seed0": "failed", "ok_seed0": "done"}
    printed = capsys.readouterr().out
    assert "[ray] 2 jobs" in printed and "[2/2" in printed
    assert not Path(sweep.REPO_ROOT / "outputs" / "00_flows_2d" / "tiny").exists()  # nothing went to the repo's outputs
