"""JupyterLab as ``make lab`` runs it: saving leaves the repository as it was, and idle kernels end.

``strip_on_save`` is the server's pre-save hook: it strips what ``make strip`` strips (nbstripout with the
Makefile's ``STRIP`` options: execution timestamps, the Python patch version, widget state; outputs and counts kept),
so a notebook opened and saved unchanged is written byte for byte as committed, and ``git status`` stays clean.
Outputs are kept: a notebook run in the lab and saved changes its stored outputs, which are nbval's references, on
purpose (``make notebooks`` refreshes them from a clean run).  ``LAB_SETTINGS`` are JupyterLab's own settings for
this virtualenv: ``.py`` files open as notebooks (jupytext), and closing a notebook's tab shuts its kernel down.
``python -m flowlib.infra.lab <settings dir>`` writes them there (``overrides.json``) and prints the server's
arguments, which ``make lab`` passes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
from nbstripout import strip_output

# nbstripout's own defaults (its command line's) and the Makefile's STRIP --extra-keys
STRIP_KEYS = ["metadata.signature", "metadata.widgets", "cell.metadata.collapsed", "cell.metadata.ExecuteTime",
              "cell.metadata.execution", "cell.metadata.heading_collapsed", "cell.metadata.hidden",
              "cell.metadata.scrolled", "metadata.language_info.version"]
IDLE_KERNEL_SECONDS = 1800  # a kernel idle this long is shut down (closing a tab does not stop its kernel)
SERVER_ARGS = ["--ContentsManager.pre_save_hook=flowlib.infra.lab.strip_on_save",
               f"--MappingKernelManager.cull_idle_timeout={IDLE_KERNEL_SECONDS}",
               "--MappingKernelManager.cull_interval=300"]
# JupyterLab's settings (plugin id -> {setting: value}), checked against its schemas by tests/test_lab.py
LAB_SETTINGS = {"@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"python": "Jupytext Notebook"}},
                "@jupyterlab/notebook-extension:tracker": {"kernelShutdown": True}}


def strip_on_save(model: dict, **kwargs) -> None:
    """The Jupyter server's ``pre_save_hook``: a notebook model stripped in place as ``make strip`` strips files."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    nb = nbformat.from_dict(model["content"])
    model["content"] = strip_output(nb, keep_output=True, keep_count=True, keep_id=False, extra_keys=STRIP_KEYS)


def write_settings(settings_dir: str | Path) -> Path:
    """``LAB_SETTINGS`` as ``<settings_dir>/overrides.json``, where JupyterLab reads a virtualenv's defaults."""
    path = Path(settings_dir) / "overrides.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(LAB_SETTINGS, indent=1) + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) > 1:
        write_settings(sys.argv[1])
    print(" ".join(SERVER_ARGS))
