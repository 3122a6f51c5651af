"""Progress of long loops, shown where the reader is: a bar in JupyterLab, a bar in a terminal, and plain
lines in a headless run (``python -m flowlib.run``, the sweep, ``make notebooks``), whose kernels cannot draw a
bar: there each update is one line, ``training: 1200/8000 [02:01<11:20, 9.90 steps/s]``, which papermill streams
to the terminal and keeps in the executed notebook.

``FLOWLIB_PROGRESS=lines`` selects the headless form (the runner sets it for its kernels); a kernel without
``ipywidgets`` uses it too, instead of tqdm's "IProgress not found" warning.
"""
from __future__ import annotations

import os
import sys

from tqdm import tqdm

PROGRESS_ENV = "FLOWLIB_PROGRESS"
LINES = "lines"
LINE_INTERVAL_S = 15.0  # a headless run prints a line at most this often per bar (and at its end)
LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"


def mode() -> str:
    """``"widget"`` in an interactive Jupyter kernel with ipywidgets, ``"lines"`` headless, else ``"terminal"``."""
    if os.environ.get(PROGRESS_ENV) == LINES:
        return LINES
    if "ipykernel" not in sys.modules:
        return "terminal"
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return LINES
    return "widget"


class _Lines:
    """A file for tqdm that turns each redraw (``\\r`` + the bar) into one printed line."""

    def __init__(self, stream):
        self.stream, self.last = stream, ""

    def write(self, text: str) -> None:
        text = text.replace("\r", "").replace("\x1b[A", "").strip()
        count = text.split(" [")[0]  # "training: 50/50": the bar's close repeats its last update
        if text and count != self.last:
            self.stream.write(text + "\n")
            self.last = count

    def flush(self) -> None:
        self.stream.flush()


class _LineBar(tqdm):
    monitor_interval = 0  # no monitor thread: it would print a second, stale line beside each timed one


def bar(total: int | None = None, desc: str = "", initial: int = 0, unit: str = "it", mininterval: float = 1.0,
        iterable=None, leave: bool = True) -> tqdm:
    """A tqdm bar of ``total`` steps for the place it runs in (see the module docstring); ``mininterval`` is the
    redraw interval of a drawn bar, a headless one prints every ``LINE_INTERVAL_S`` at most.  ``leave=False``: a
    bar that goes when done (a short evaluation inside a training run shows only while it lasts)."""
    kwargs = dict(iterable=iterable, total=total, desc=desc, initial=initial, unit=unit, leave=leave)
    where = mode()
    if where == "widget":
        from tqdm.notebook import tqdm as notebook_tqdm

        return notebook_tqdm(mininterval=mininterval, **kwargs)
    if where == LINES:  # a bar that goes when done shows only if it lasts (a quick evaluation prints nothing)
        return _LineBar(file=_Lines(sys.stdout), mininterval=LINE_INTERVAL_S, bar_format=LINE_FORMAT,
                        ascii=True, delay=0 if leave else LINE_INTERVAL_S, **kwargs)
    return tqdm(mininterval=mininterval, **kwargs)


def say(message: str) -> None:
    """One stage line (``generating 150 demos ...``), shown at once in every mode."""
    print(message, flush=True)
