"""Run folders and atomic writes: where a run's artefacts go, written so nothing is ever half-saved.

Layout: ``outputs/<notebook>/<run_name>/`` holds ``params.yaml`` (resolved parameters),
``metrics.jsonl`` / ``metrics.csv`` / ``summary.json``, ``*.png`` figures, checkpoints and, when
run through ``python -m flowlib.run``, the executed notebook.  ``FLOWLIB_OUTPUTS`` moves the root.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]  # flowlib/infra/runs.py


RUN_KIND_ENV = "FLOWLIB_RUN_KIND"  # "lab" in the JupyterLab that `make lab` starts; unset: a batch run


def outputs_root() -> Path:
    return Path(os.environ.get("FLOWLIB_OUTPUTS", REPO_ROOT / "outputs"))


def run_kind() -> str:
    """"lab" for a notebook run in the JupyterLab that ``make lab`` starts (``FLOWLIB_RUN_KIND=lab``, which its
    kernels inherit), else "batch" (``make demo``, ``python -m flowlib.run``, papermill, the tests)."""
    return "lab" if os.environ.get(RUN_KIND_ENV) == "lab" else "batch"


def default_run_name() -> str:
    """The run folder of a run that names none: ``lab`` in the lab, ``default`` in a batch run, so that working in
    JupyterLab never resumes or clobbers ``make demo``'s runs (and a lab run's default start is the lab's own)."""
    return "lab" if run_kind() == "lab" else "default"


def check_run_name(run_name: str) -> None:
    """A sweep nests its runs one level down (``<sweep>/<job>``); every part must be a plain folder name."""
    parts = run_name.split("/") if run_name else [""]
    if len(parts) > 2 or any(not p or p.startswith(".") or "\\" in p for p in parts):
        raise ValueError(f"run_name must be a plain folder name (or sweep/job), got {run_name!r}")


def run_dir(notebook: str, run_name: str) -> Path:
    """``outputs/<notebook>/<run_name>/``, created if missing (``check_run_name`` says which names are allowed)."""
    check_run_name(run_name)
    path = outputs_root() / notebook / run_name
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_commit() -> str:
    """The repository's commit, ``+dirty`` when a tracked file differs from it; ``""`` outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode:
            return ""
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty else "")


def machine() -> str:
    """What ran it, in words: the GPU if torch sees one, else the CPU, with the core count."""
    import torch  # torch is heavy: only where a machine is asked for

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA), {os.cpu_count()} CPU cores"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, no GPU"


def provenance(command: str) -> dict[str, str]:
    """Where a result came from: its ``command``, the commit and machine it ran on, and when (UTC)."""
    return {"command": command, "commit": git_commit(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def shown(path: Path) -> str:
    """``path`` as a reader finds it: relative to the repository when inside it (``outputs/01_shortcut_bc/default``),
    else absolute (a ``FLOWLIB_OUTPUTS`` root elsewhere)."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def checkpoint_location(value: str) -> Path:
    """Where the stage-1/2 ``best_model.pt`` a parameter names lies, whether or not it is there yet: absolute, or
    relative to the outputs root (``01_shortcut_bc/cpu/best_model.pt``); empty means notebook 01's default run
    (``default_run_name``: its ``lab`` run in the lab)."""
    path = Path(value or f"01_shortcut_bc/{default_run_name()}/best_model.pt")
    return path if path.is_absolute() else outputs_root() / path


def policy_checkpoint(value: str, key: str) -> Path:
    """The stage-1/2 ``best_model.pt`` a parameter ``key`` names (``checkpoint_location``), which must exist."""
    path = checkpoint_location(value)
    if not path.is_file():
        raise FileNotFoundError(f"{key}: checkpoint {path} not found: {_how_to_make(path)} or set {key} to a "
                                "best_model.pt")
    return path


def run_that_writes(path: Path) -> tuple[str, Path | None] | None:
    """``(notebook, params file or None for its defaults)`` of the run that writes ``path``
    (``<notebook>/<run>/[seed_<s>/]best_model.pt`` under the outputs root), when that run is notebook 01's or 02's
    default or one of their params/ files; else None."""
    try:
        notebook, run = Path(path).relative_to(outputs_root()).parts[:2]
    except ValueError:  # outside the outputs root, or too short to name a run
        return None
    if notebook not in ("01_shortcut_bc", "02_aw_shortcut"):
        return None
    if run == default_run_name():
        return notebook, None
    params = Path("params") / notebook / f"{run}.yaml"
    return (notebook, params) if (REPO_ROOT / params).is_file() else None


def _how_to_make(path: Path) -> str:
    """The command whose run writes ``path`` (``run_that_writes``)."""
    run = run_that_writes(path)
    if run is None:
        return "run notebook 01 first (python -m flowlib.run 01_shortcut_bc)"
    notebook, params = run
    return f"run notebook {notebook[:2]} first (python -m flowlib.run {notebook}" + (
        f" --params {params})" if params else ")")


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def _atomic_write(path: Path, write) -> Path:
    """Write to a temporary file in the same folder, then rename over ``path`` (atomic on POSIX).  The file gets
    the mode an ``open()`` would give it (0666 less the process umask), not ``mkstemp``'s private 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save_text(path: Path, text: str) -> Path:
    return _atomic_write(path, lambda f: f.write(text.encode()))


def save_json(path: Path, obj: Any) -> Path:
    return save_text(path, json.dumps(obj, indent=2, default=_jsonable) + "\n")


def read_metrics(run_path: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (one JSON object per line), ``[]`` when there is none."""
    path = Path(run_path) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def save_params(run_path: Path, cfg) -> Path:
    """Write the resolved parameters of a run as ``params.yaml``."""
    values = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    return save_text(Path(run_path) / "params.yaml", yaml.safe_dump(values, sort_keys=False))


def rng_state() -> dict[str, Any]:
    """torch's global generators, for a checkpoint: the CPU's and, on a GPU machine, CUDA's (a GPU run draws its
    flow-matching noise and TD3's target noise there), so that a resumed run draws what an unbroken one would."""
    import torch

    return {"rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(ckpt: dict[str, Any]) -> None:
    """Rewind the generators ``rng_state`` saved into ``ckpt`` (CUDA's only on a machine with as many GPUs; a
    checkpoint from before CUDA's was saved, or from a CPU machine, rewinds the CPU's alone)."""
    import torch

    torch.set_rng_state(ckpt["rng"])
    cuda = ckpt.get("cuda_rng")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def save_torch(obj: Any, path: Path) -> Path:
    """``torch.save`` atomically: a crash mid-write leaves the previous file intact."""
    import torch

    return _atomic_write(path, lambda f: torch.save(obj, f))


def load_torch(path: Path, missing: str) -> Any:
    """``torch.load`` (on the CPU) of a file this project wrote, with errors that say what is wrong: ``missing``
    (how to make the file) when there is none, and the file named when torch cannot read it (not a checkpoint,
    or cut short by a copy)."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found: {missing}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # pickle, zip or EOF errors, whichever torch meets first
        raise ValueError(f"{path} is not a readable torch checkpoint ({type(err).__name__}: {err}); "
                         "pass a best_model.pt / last.pt that a flowlib run wrote") from err


def save_figure(fig, run_path: Path, name: str, dpi: int = 110) -> Path:
    """Save a matplotlib figure as ``<run>/<name>.png``, after ``check_figure``: every axis with a scale is
    labelled, and a plot whose values are all zero says so (on the small defaults a success of 0 is a result, not
    a broken plot)."""
    problems = check_figure(fig)
    if problems:
        raise ValueError(f"figure {name!r}: " + "; ".join(problems))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return _atomic_write(Path(run_path) / f"{name}.png", lambda f: f.write(buf.getvalue()))


def check_figure(fig) -> list[str]:
    """What a reader of ``fig`` would miss: a title (the figure's, or each plotted axes' own), an axis with tick labels
    but no label (its own, or that of an axes sharing it); and it writes the values on bars that are all zero and a
    note on axes whose lines are all zero."""
    problems = []
    suptitle = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) is not None else ""
    untitled = [i for i, ax in enumerate(fig.axes) if ax.axison and (ax.lines or ax.patches or ax.collections)
                and not ax.images and not ax.get_title()]
    if untitled and not suptitle:
        problems.append(f"axes {untitled} have no title and the figure no suptitle: say what the figure shows")
    for ax in fig.axes:
        if not ax.axison or ax.images or not (ax.lines or ax.patches or ax.collections):
            continue  # a picture (frames), an empty panel, a colourbar
        title = ax.get_title() or ax.get_label() or f"axes {fig.axes.index(ax)}"
        for which, ticks, label, shared in (("x", ax.get_xticks(), ax.get_xlabel, ax.get_shared_x_axes()),
                                            ("y", ax.get_yticks(), ax.get_ylabel, ax.get_shared_y_axes())):
            labelled = any((a.get_xlabel if which == "x" else a.get_ylabel)() for a in shared.get_siblings(ax))
            if len(ticks) and not label() and not labelled:
                problems.append(f"{title!r} has no {which} label (ax.set_{which}label)")
        bars = [c for c in ax.containers if hasattr(c, "datavalues")]
        if bars and all(np.allclose(c.datavalues, 0) for c in bars):
            for c in bars:
                ax.bar_label(c, fmt="%.2f", fontsize=8)
        ys = [np.asarray(line.get_ydata(), dtype=float) for line in ax.lines if len(line.get_ydata())]
        if ys and not bars and all(np.allclose(y, 0) for y in ys):
            ax.text(0.5, 0.5, "all values are 0", transform=ax.transAxes, ha="center", va="center", color="0.4")
    return problems


def _jsonable(x):
    if hasattr(x, "tolist"):  # tensors and numpy arrays/scalars (0-d gives a plain number)
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
