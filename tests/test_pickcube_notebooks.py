"""The notebooks' defaults run on fast torch tasks (``make demo`` shows each stage working); ManiSkill's path through
notebooks 01 -> 02 -> 06 is kept in ``make test`` here, at the smoke sizes the defaults had before
(``params/<notebook>/pickcube_smoke.yaml``): demos by motion planning, the U-Net clone, stage 2 from it, the
per-step residual by TD3 from it, each through ``python -m flowlib.run`` as a researcher runs it."""
import json
import os

import pytest

from flowlib.infra.runs import REPO_ROOT, outputs_root
from flowlib.tools import run

pytestmark = [pytest.mark.sim, pytest.mark.slow]  # ManiSkill, and three notebooks executed


def test_pickcube_runs_through_notebooks_01_02_and_06_at_smoke_size(tmp_path, monkeypatch):
    shared = outputs_root() / "data"  # the demos, generated once per outputs root
    shared.mkdir(parents=True, exist_ok=True)
    os.symlink(shared, tmp_path / "data")
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    for notebook in ("01_shortcut_bc", "02_aw_shortcut", "06_steering"):
        params = REPO_ROOT / "params" / notebook / "pickcube_smoke.yaml"
        assert run.main([notebook, "--params", str(params)]) == 0, f"{notebook} failed on {params.name}"
    stage1 = json.loads((tmp_path / "01_shortcut_bc" / "pickcube_smoke" / "summary.json").read_text())
    assert [r["inference steps"] for r in stage1["results"]] == [1, 2, 4, 8]
    assert (tmp_path / "01_shortcut_bc" / "pickcube_smoke" / "ddpm").is_dir()  # the twin trained beside it
    assert (tmp_path / "02_aw_shortcut" / "pickcube_smoke" / "02_aw_shortcut.ipynb").is_file()
    steering = json.loads((tmp_path / "06_steering" / "pickcube_smoke" / "summary.json").read_text())
    assert steering["method"] == "residual_step/td3" and steering["env_steps"] >= 1024
    assert str(steering["init_checkpoint"]).endswith("01_shortcut_bc/pickcube_smoke/best_model.pt")
