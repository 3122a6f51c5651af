"""Sweeps: one notebook over a folder of parameter files x seeds, each run a papermill job.

    python -m flowlib.sweep run 03_reinflow params/03_reinflow/ablations --seeds 0 1 2 --gpus 0 1 2 3
    python -m flowlib.sweep run 03_reinflow params/03_reinflow/ablations --seeds 0 1 2 --dry-run
    python -m flowlib.sweep run 03_reinflow params/03_reinflow/ablations --seeds 0 1 2 --backend ray
    python -m flowlib.sweep monitor outputs/03_reinflow/ablations

At CPU scale, the same 22 settings with what does not fit a CPU overridden for every job (``-p``, as in
``python -m flowlib.run``; a key that some file ablates is refused, since overriding it would erase that
ablation):

    python -m flowlib.sweep run 03_reinflow params/03_reinflow/ablations --sweep-name ablations_cpu \
        -p init_checkpoint=01_shortcut_bc/cpu100/best_model.pt -p num_envs=4 -p total_env_steps=49152 ...

Job ``<stem>_seed<s>`` runs ``python -m flowlib.run <notebook> --params <file> -p seed=<s>`` in its
own OS process, into ``outputs/<notebook>/<sweep>/<stem>_seed<s>/``.  A job whose folder holds
``summary.json`` (the notebook's last write) is finished and skipped, so a sweep resumes by running
the same command again.  A failing job writes ``error.txt`` and the others go on; a job the plan can
tell will fail (``flowlib.tools.run.preflight``: e.g. K = 16 from a start trained for 8 steps) is listed as
``fail`` by ``--dry-run`` and recorded without being started.

Backends: ``local`` runs one job per listed GPU at a time (``CUDA_VISIBLE_DEVICES``; ``--gpus``
empty = ``--jobs`` CPU jobs); ``ray`` submits the same jobs as Ray tasks to a running cluster
(``--ray-address``, default ``auto``: the cluster this machine belongs to, as ``ray start`` made it), one GPU
per job when the cluster has GPUs, else one CPU (``--gpus-per-job`` to choose).  Ray places and retries
nothing by our code: no scheduler of our own beyond a GPU pool.  Every node needs this repository at the same
path with its environment, and the outputs folder on storage they share (``FLOWLIB_OUTPUTS``).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flowlib.infra.config import ConfigError, load_yaml
from flowlib.infra.runs import REPO_ROOT, outputs_root, save_json, shown
from flowlib.tools.run import config_class, parse_overrides, preflight, resolve_parameters


@dataclass
class Job:
    name: str          # <stem>_seed<s>
    params_file: str
    seed: int
    run_name: str      # <sweep>/<name>
    out_dir: str
    overrides: dict = field(default_factory=dict)  # -p KEY=VALUE given to every job of the sweep
    problem: str = ""  # why it cannot run (flowlib.tools.run.preflight): recorded as failed, never started
    outputs: str = ""  # the outputs root the job writes under (FLOWLIB_OUTPUTS), passed to workers on other nodes

    @property
    def finished(self) -> bool:
        return (Path(self.out_dir) / "summary.json").exists()

    @property
    def failed(self) -> bool:
        return (Path(self.out_dir) / "error.txt").exists() and not self.finished

    def command(self, notebook: str) -> list[str]:
        sets = [f"{k}={json.dumps(v)}" for k, v in self.overrides.items()]  # JSON is YAML: parsed back exactly
        return [sys.executable, "-m", "flowlib.run", notebook, "--params", self.params_file,
                *[arg for kv in sets for arg in ("-p", kv)], "-p", f"seed={self.seed}", "--run-name", self.run_name]


def ablated_keys(files: list[Path]) -> dict[str, str]:
    """Keys whose value differs from the first file's -> the first file where it differs."""
    first, out = load_yaml(files[0]), {}
    for f in files[1:]:
        values = load_yaml(f)
        for k in sorted(first.keys() | values.keys()):
            if values.get(k) != first.get(k):
                out.setdefault(k, f.stem)
    return out


def plan(notebook: str, params_dir: str | Path, seeds: list[int], sweep_name: str | None = None,
         overrides: dict | None = None) -> list[Job]:
    """Every (parameter file, seed) pair, validated against the notebook's config before anything runs.
    ``overrides`` apply to every job; one that would overwrite what a file ablates is refused."""
    params_dir = Path(params_dir)
    files = sorted(params_dir.glob("*.yaml"))
    if not files:
        raise ConfigError(f"no *.yaml parameter files in {params_dir}")
    config_class(notebook)  # unknown notebook -> clear error
    overrides = dict(overrides or {})
    if "seed" in overrides:
        raise ConfigError("-p seed=... would give every job one seed: use --seeds")
    clash = {k: f for k, f in ablated_keys(files).items() if k in overrides}
    if clash:
        raise ConfigError("-p would overwrite what the sweep ablates: " + ", ".join(
            f"{k} (varied by {f}.yaml)" for k, f in clash.items()) + "; override only keys every file shares")
    sweep = sweep_name or params_dir.name
    jobs = []
    for f in files:
        for s in seeds:
            name = f"{f.stem}_seed{s}"
            run_name = f"{sweep}/{name}"
            values = resolve_parameters(notebook, str(f), {**overrides, "seed": s}, run_name)  # a typo stops the plan
            jobs.append(Job(name, str(f), s, run_name, str(outputs_root() / notebook / sweep / name), overrides,
                            preflight(notebook, values, require_inputs=False), str(outputs_root())))
    return jobs


def run_job(job: Job, notebook: str, gpu: str | None = None) -> dict:
    """Run one job in a subprocess; returns its status row (never raises for a failed run)."""
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "error.txt").unlink(missing_ok=True)
    env = dict(os.environ)
    if job.outputs:
        env["FLOWLIB_OUTPUTS"] = job.outputs  # a Ray worker has its node's environment, not the driver's
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    t0 = time.time()
    with open(out / "job.log", "w") as log:
        proc = subprocess.run(job.command(notebook), cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    status = "done" if proc.returncode == 0 and job.finished else "failed"
    if status == "failed":
        tail = (out / "job.log").read_text()[-4000:]
        (out / "error.txt").write_text(f"exit code {proc.returncode}\n{tail}")
    return {"job": job.name, "status": status, "gpu": gpu, "wall_s": round(time.time() - t0, 1)}


def record_unstartable(job: Job) -> dict:
    """A job the plan knows cannot run: its ``error.txt`` says why; nothing is started."""
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "error.txt").write_text(f"not started: {job.problem}\n")
    print(f"[failed] {job.name} (not started: {job.problem})", flush=True)
    return {"job": job.name, "status": "failed", "gpu": None, "wall_s": 0.0}


def run_local(jobs: list[Job], notebook: str, gpus: list[str], max_jobs: int = 1) -> list[dict]:
    """At most one job per GPU (or ``max_jobs`` CPU jobs) at a time, from a pool of free devices.  Each start and
    end is a line (``[3/66 done] lr_1e-4_3e-4/s1 (412.0s)``); a job's own progress streams to its ``job.log``."""
    slots: queue.Queue = queue.Queue()
    for g in (gpus or [None] * max_jobs):
        slots.put(g)
    ended, lock = [0], threading.Lock()

    def one(job: Job) -> dict:
        gpu = slots.get()
        try:
            print(f"[start] {job.name}" + (f" on GPU {gpu}" if gpu is not None else "")
                  + f", progress in {shown(Path(job.out_dir) / 'job.log')}", flush=True)
            row = run_job(job, notebook, gpu)
        finally:
            slots.put(gpu)
        with lock:
            ended[0] += 1
            print(f"[{ended[0]}/{len(jobs)} {row['status']}] {job.name} ({row['wall_s']}s)", flush=True)
        return row

    with ThreadPoolExecutor(max_workers=slots.qsize()) as pool:
        return list(pool.map(one, jobs))


def run_ray(jobs: list[Job], notebook: str, address: str = "auto", gpus_per_job: float | None = None) -> list[dict]:
    """The same jobs as Ray tasks on a running cluster at ``address``: ``gpus_per_job`` GPUs each (default: 1 when
    the cluster has GPUs, else 0 and one CPU).  Ray sets each task's ``CUDA_VISIBLE_DEVICES``; every start and end
    is a line, as with the local backend."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("--backend ray needs Ray: pip install -e '.[ray]' and start a cluster (ray start --head)") from err
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    if gpus_per_job is None:
        gpus_per_job = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    remote = ray.remote(num_gpus=gpus_per_job, num_cpus=0 if gpus_per_job else 1, max_retries=0)(run_job)
    pending = {remote.remote(job, notebook, None): job for job in jobs}
    print(f"[ray] {len(jobs)} jobs on {address}, {gpus_per_job} GPU each; progress in each job's job.log", flush=True)
    rows = {}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        job = pending.pop(done[0])
        rows[job.name] = row = ray.get(done[0])
        print(f"[{len(rows)}/{len(jobs)} {row['status']}] {job.name} ({row['wall_s']}s)", flush=True)
    return [rows[job.name] for job in jobs]


def run_sweep(notebook: str, params_dir: str | Path, seeds: list[int], gpus: list[str] | None = None,
              max_jobs: int = 1, backend: str = "local", dry_run: bool = False, sweep_name: str | None = None,
              overrides: dict | None = None, ray_address: str = "auto", gpus_per_job: float | None = None) -> dict:
    jobs = plan(notebook, params_dir, seeds, sweep_name, overrides)
    todo = [j for j in jobs if not j.finished]
    sweep_dir = Path(jobs[0].out_dir).parent
    blocked = sum(bool(j.problem) for j in todo)
    print(f"sweep {sweep_dir}: {len(jobs)} jobs ({len(jobs) - len(todo)} finished, {len(todo)} to run"
          + (f", {blocked} of them cannot start" if blocked else "") + f"), backend {backend}")
    if overrides:
        print("  every job: " + " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items()))
    for j in jobs:
        print(f"  {'skip' if j.finished else 'fail' if j.problem else 'run '}  {j.name:40s} {j.params_file}  seed={j.seed}"
              + (f"\n        will not start: {j.problem}" if j.problem and not j.finished else ""))
    if dry_run:
        return {"jobs": len(jobs), "todo": len(todo), "ran": []}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    save_json(sweep_dir / "sweep.json", {"notebook": notebook, "params_dir": str(params_dir), "seeds": seeds,
                                         "overrides": dict(overrides or {}), "jobs": [asdict(j) for j in jobs]})
    if backend not in ("local", "ray"):
        raise ValueError(f"backend must be 'local' or 'ray', got {backend!r}")
    rows = [record_unstartable(j) for j in todo if j.problem]
    runnable = [j for j in todo if not j.problem]
    if runnable:
        rows += (run_ray(runnable, notebook, ray_address, gpus_per_job) if backend == "ray"
                 else run_local(runnable, notebook, gpus or [], max_jobs))
    failed = [r["job"] for r in rows if r["status"] != "done"]
    print(f"done: {len(rows) - len(failed)} ok, {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""))
    return {"jobs": len(jobs), "todo": len(todo), "ran": rows}


def monitor(sweep_dir: str | Path) -> list[dict]:
    """One row per job of a sweep folder: status, env steps reached, last training / eval success."""
    sweep_dir = Path(sweep_dir)
    meta_path = sweep_dir / "sweep.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found: is {sweep_dir} a sweep folder (python -m flowlib.sweep run ...)?")
    meta = json.loads(meta_path.read_text())
    rows = []
    for j in meta["jobs"]:
        job = Job(**j)
        out = Path(job.out_dir)
        metrics = out / "metrics.jsonl"
        last = {}
        if metrics.exists():
            lines = [line for line in metrics.read_text().splitlines() if line.strip()]
            last = json.loads(lines[-1]) if lines else {}
        status = "done" if job.finished else "failed" if job.failed else "running" if metrics.exists() else "pending"
        rows.append({"job": job.name, "status": status, "env_steps": last.get("step"),
                     "train_success": last.get("train/success_once"), "eval_success": last.get("eval/success_once")})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowlib.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a notebook over a folder of params x seeds")
    r.add_argument("notebook")
    r.add_argument("params_dir")
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--gpus", nargs="*", default=[], help="GPU ids, one job per GPU at a time (local backend)")
    r.add_argument("--jobs", type=int, default=1, help="concurrent CPU jobs when no --gpus are given")
    r.add_argument("--backend", choices=["local", "ray"], default="local")
    r.add_argument("--ray-address", default="auto", help="the Ray cluster (ray backend): auto, or HEAD_IP:6379")
    r.add_argument("--gpus-per-job", type=float, help="GPUs per Ray task (default: 1 if the cluster has GPUs, else 0)")
    r.add_argument("--sweep-name", help="folder under outputs/<notebook>/ (default: the params folder's name)")
    r.add_argument("-p", "--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one parameter in every job (not one the files ablate)")
    r.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    m = sub.add_parser("monitor", help="progress of a sweep folder")
    m.add_argument("sweep_dir")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "run":
            out = run_sweep(args.notebook, args.params_dir, args.seeds, args.gpus, args.jobs, args.backend,
                            args.dry_run, args.sweep_name, parse_overrides(args.set), args.ray_address,
                            args.gpus_per_job)
            return 1 if any(r["status"] != "done" for r in out["ran"]) else 0
        rows = monitor(args.sweep_dir)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "running", "failed", "pending")}
    print(" · ".join(f"{k} {v}" for k, v in counts.items()))
    for row in rows:
        fmt = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
        print(f"  {row['status']:8s} {row['job']:40s} steps {fmt(row['env_steps']):>8s}  "
              f"train {fmt(row['train_success']):>5s}  eval {fmt(row['eval_success']):>5s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
