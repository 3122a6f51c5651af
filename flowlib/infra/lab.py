"""JupyterLab as ``make lab`` runs it: saving leaves the repository as it was, and idle kernels end.

``strip_on_save`` is the server's pre-save hook: it strips what ``make strip`` strips (nbstripout with the
Makefile's ``STRIP`` options: execution timestamps, the Python patch version, widget state; outputs and counts kept),
so a notebook opened and saved unchanged is written byte for byte as committed, and ``git status`` stays clean.
Outputs are kept: a notebook run in the lab and saved changes its stored outputs, which are nbval's references, on
purpose (``make notebooks`` refreshes them from a clean run).  ``python -m flowlib.infra.lab`` prints the server's
arguments, which ``make lab`` passes.
"""
from __future__ import annotations

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


def strip_on_save(model: dict, **kwargs) -> None:
    """The Jupyter server's ``pre_save_hook``: a notebook model stripped in place as ``make strip`` strips files."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    nb = nbformat.from_dict(model["content"])
    model["content"] = strip_output(nb, keep_output=True, keep_count=True, keep_id=False, extra_keys=STRIP_KEYS)


if __name__ == "__main__":
    print(" ".join(SERVER_ARGS))
