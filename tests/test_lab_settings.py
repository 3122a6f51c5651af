"""``make lab``'s JupyterLab settings (``flowlib.infra.lab.LAB_SETTINGS``) name settings the installed JupyterLab has:
JupyterLab ignores an unknown key silently, so a renamed setting would quietly stop closing kernels with their tabs."""
import json
import sys
from pathlib import Path

from flowlib.infra import lab

SCHEMAS = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas"
JSON_TYPES = {bool: "boolean", dict: "object", str: "string", int: "integer"}


def test_every_lab_setting_is_one_the_installed_jupyterlab_declares_with_that_type():
    assert lab.LAB_SETTINGS["@jupyterlab/notebook-extension:tracker"]["kernelShutdown"] is True  # tabs end kernels
    for plugin, settings in lab.LAB_SETTINGS.items():
        package, name = plugin.split(":")
        schema = json.loads((SCHEMAS / package / f"{name}.json").read_text())
        for key, value in settings.items():
            assert key in schema["properties"], f"{plugin} has no setting {key!r}"
            declared = schema["properties"][key].get("type")
            assert declared in (None, JSON_TYPES[type(value)]), f"{plugin}.{key}: {declared}, not {type(value)}"


def test_the_settings_are_written_where_jupyterlab_reads_a_virtualenvs_overrides(tmp_path):
    path = lab.write_settings(tmp_path / "settings")
    assert path == tmp_path / "settings" / "overrides.json"
    assert json.loads(path.read_text()) == lab.LAB_SETTINGS
