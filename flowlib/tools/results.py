"""Results as data: the files behind a published number, committed under ``results/<record>/``.

    python -m flowlib.results publish outputs/evaluate/metaworld_pick_place_cosine --as metaworld/pick_place_cosine
    python -m flowlib.results tables   # rewrite the results tables in docs/ and the README from results/
    python -m flowlib.results check
    python -m flowlib.results compare results/metaworld/pick_place_dsrl '*dsrl_s0*' --against results/metaworld/pick_place_cosine --group '*cosine_s*'

``outputs/`` is git-ignored; ``results/`` is not.  A record is one evaluation (``flowlib.tools.evaluate``'s folder) and
the runs it scored, copied so that a reader can re-derive every number a results page quotes from it:

* ``results.csv``, ``per_episode.csv``, ``summary.json``: the evaluation as it was written;
* ``per_episode_return.csv.gz`` (and ``per_episode_flags.csv.gz``): its other per-episode files, gzipped (they are
  most of a record's bytes; ``pandas.read_csv`` and ``zcat`` read them as they are);
* ``params/<run>.yaml``: the resolved parameters of each run whose checkpoint was scored (``<run>`` is the row's
  label, ``/`` read as ``__``);
* ``record.json``: the command that made the evaluation, the commit and the machine it ran on (recorded by
  ``flowlib.tools.evaluate`` since 2026-12-06; for an older folder the command is rebuilt from its files and the commit
  is marked as not recorded), the checkpoints, and when the record was published.

A **2D-flows record** holds notebook 00's table instead of an evaluation (``publish outputs/00_flows_2d/<run> --as
stage0/<name>``): ``sliced_wasserstein.csv`` (target x model x number of steps, with the data's own floor),
``params/<run>.yaml``, and ``record.json`` with the command that re-runs it from those params and the commit and
machine the notebook recorded (``provenance.json``).  Its distances come from 4,000 samples per cell, too many to
commit, so ``check`` holds the table to its shape (every cell finite and non-negative, a floor per target) rather
than re-deriving it; re-running the command re-derives it.

Checkpoints and metrics streams stay out: the whole folder keeps within ``BUDGET_BYTES`` (``check``).  ``check``
also re-derives every record's success rates and paired differences from its per-episode file, so a
``results.csv`` cannot drift from the episodes it summarises.

**Tables from the data.**  A page marks a table as a record's with ``<!-- table: <record> -->`` before it and
``<!-- end table -->`` after it; ``tables`` writes the table between them from the record's ``results.csv`` (one row
per evaluated policy: success, its paired difference from the first row, success at the episode's end), and
``check`` fails on a marked table that differs from what the record gives, naming the page and the record.
``<!-- verdicts: <record> -->`` marks a sweep's table instead: each setting against the sweep's baseline, paired on
the record's episodes and averaged over training seeds (``flowlib.tools.verdicts``).

**The README's rows.**  A results-at-a-glance row that links ``results/...`` (its *data* link) may quote only
numbers its records hold: each decimal within half a unit of its last digit of a success, an SE, a paired
difference or a success at the end there.  A row without such a link says ``record only`` (its files are gone).
``check`` fails otherwise, naming the README's line and the number.
"""
from __future__ import annotations

import argparse
import fnmatch
import gzip
import json
import re
import shutil
import sys
from pathlib import Path

import pandas as pd

from flowlib.infra.metrics import paired_means, success_rates
from flowlib.infra.runs import REPO_ROOT, git_commit, outputs_root, save_json, shown
from flowlib.tools import verdicts
from flowlib.tools.evaluate import labels

RESULTS_ROOT = REPO_ROOT / "results"
BUDGET_BYTES = 5 * 2**20  # the whole results/ folder: per-episode files are a few KB each
EVALUATION_FILES = ("results.csv", "per_episode.csv", "summary.json")  # what makes a folder an evaluation
OPTIONAL_FILES = ("per_episode_return.csv", "per_episode_flags.csv")  # committed gzipped, as <name>.gz
FLOWS_2D_TABLE = "sliced_wasserstein.csv"  # notebook 00's table: what makes a run folder, and a record, 2D flows'
FLOWS_2D_FLOOR = "data (floor)"  # the row of two independent reference sets, per target


def write_gzip(src: Path, dest: Path) -> None:
    """``src`` gzipped to ``dest``, byte for byte the same for the same input (no name or time in the header), so
    re-publishing an unchanged evaluation changes nothing in git."""
    with open(dest, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as out:
        out.write(src.read_bytes())


def uncompressed(root: Path) -> list[str]:
    """A line per optional per-episode file committed under ``root`` without its gzip (``check``)."""
    return [f"{shown(p)} is not gzipped: publish writes it as {p.name}.gz (gzip -9n {shown(p)})"
            for name in OPTIONAL_FILES for p in sorted(root.rglob(name))]


def run_folder(checkpoint: Path) -> Path | None:
    """The run folder that holds ``checkpoint``'s ``params.yaml``: its folder or the nearest one above it (a stage-2
    training seed's ``seed_0/last.pt`` belongs to the notebook's run)."""
    for folder in [checkpoint.parent, *checkpoint.parent.parents]:
        if (folder / "params.yaml").is_file():
            return folder
        if folder == outputs_root():
            break
    return None


def base_label(policy: str) -> str:
    """A results row's checkpoint label without its ``@K4`` / ``@ah4`` / ``@noisy`` suffixes."""
    return policy.split("@")[0]


def _check_checkpoints(src: Path, rows: list[dict], checkpoints: list[Path]) -> None:
    """The checkpoints must be the evaluation's: ``flowlib.tools.evaluate.labels`` gives them its rows' labels, in order."""
    wanted = list(dict.fromkeys(base_label(r["policy"]) for r in rows))
    got = list(labels(checkpoints).values())
    if got != wanted:
        raise ValueError(f"{shown(src)} scored {wanted}, but the checkpoints given are labelled {got}: give the "
                         "evaluation's own checkpoints, in its order")


def destination(record: str, force: bool) -> Path:
    """``results/<record>``, refusing a name that is not a plain relative path, and an existing record unless ``force``."""
    parts = Path(record).parts
    if not parts or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise ValueError(f"--as must be a relative record name such as metaworld/pick_place, got {record!r}")
    dest = RESULTS_ROOT / record
    if dest.exists() and not force:
        raise FileExistsError(f"{shown(dest)} exists: publish under another name, or add --force to replace it")
    return dest


def publish_flows_2d(src: Path, record: str, force: bool = False) -> Path:
    """Copy notebook 00's run folder ``src`` (its table, resolved params and provenance) into ``results/<record>/``."""
    if not (src / "params.yaml").is_file():
        raise FileNotFoundError(f"{shown(src)} has {FLOWS_2D_TABLE} but no params.yaml: publish the run folder "
                                "notebook 00 wrote, outputs/00_flows_2d/<run_name>")
    problems = flows_2d_problems(src / FLOWS_2D_TABLE)
    if problems:
        raise ValueError("; ".join(problems))
    dest = destination(record, force)
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "params").mkdir(parents=True)
    shutil.copy2(src / FLOWS_2D_TABLE, dest / FLOWS_2D_TABLE)
    params = dest / "params" / f"{src.name}.yaml"
    shutil.copy2(src / "params.yaml", params)
    made = json.loads((src / "provenance.json").read_text()) if (src / "provenance.json").is_file() else {
        "commit": "not recorded"}
    save_json(dest / "record.json", {"record": record, "source": shown(src), **made,
                                     "command": f"python -m flowlib.run 00_flows_2d --params {shown(params)}",
                                     "published_at": git_commit()})
    return dest


def flows_2d_steps(table_: pd.DataFrame) -> list[str]:
    """The columns of notebook 00's table that hold distances, one per number of steps (``1 step``, ``8 steps``)."""
    return [c for c in table_ if c not in ("target", "method")]


def flows_2d_problems(path: Path) -> list[str]:
    """What is wrong with notebook 00's table at ``path``: a cell that is not a finite, non-negative distance, or a
    target without its data floor (``check``'s test of a 2D record, whose samples are not committed)."""
    table_ = pd.read_csv(path)
    steps = flows_2d_steps(table_)
    if not {"target", "method"} <= set(table_) or not steps:
        return [f"{shown(path)}: expected the columns target, method and one per number of steps, got {list(table_)}"]
    values = table_[steps].apply(pd.to_numeric, errors="coerce")
    bad = table_[~(values.ge(0) & values.lt(float("inf"))).all(axis=1)]
    problems = [f"{shown(path)}: {r.target} / {r.method} has a distance that is not finite and non-negative"
                for r in bad.itertuples()]
    problems += [f"{shown(path)}: target {t} has no {FLOWS_2D_FLOOR!r} row"
                 for t in table_["target"].unique() if not (table_["target"].eq(t) & table_["method"].eq(FLOWS_2D_FLOOR)).any()]
    return problems


def publish(src: str | Path, record: str, checkpoints: list[str] | None = None, force: bool = False) -> Path:
    """Copy the evaluation folder ``src`` and its runs' parameters into ``results/<record>/`` (module docstring).
    ``checkpoints``: the evaluated checkpoint paths, needed only for a folder written before ``flowlib.tools.evaluate``
    recorded them."""
    src = Path(src)
    if (src / FLOWS_2D_TABLE).is_file():
        return publish_flows_2d(src, record, force)
    missing = [f for f in EVALUATION_FILES if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src} is not an evaluation folder (no {', '.join(missing)}): publish the folder "
                                "python -m flowlib.evaluate wrote, outputs/evaluate/<run-name>, or a notebook 00 run "
                                f"folder (with its {FLOWS_2D_TABLE})")
    dest = destination(record, force)
    summary = json.loads((src / "summary.json").read_text())
    rows = summary["rows"]
    recorded = summary.get("checkpoints")
    paths = [Path(p) for p in (checkpoints or recorded or [])]
    if not paths:
        raise ValueError(f"{src}/summary.json does not list its checkpoints (an evaluation from before 2026-12-06): "
                         "give them with --checkpoints, in the evaluation's order")
    paths = [p if p.is_absolute() or p.exists() else REPO_ROOT / p for p in paths]
    _check_checkpoints(src, rows, paths)
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "params").mkdir(parents=True)
    for name in EVALUATION_FILES:
        shutil.copy2(src / name, dest / name)
    for name in OPTIONAL_FILES:
        if (src / name).is_file():
            write_gzip(src / name, dest / f"{name}.gz")
    runs = {}
    for path, label in labels(paths).items():
        folder = run_folder(Path(path))
        if folder is None:
            raise FileNotFoundError(f"no params.yaml in the run folder of {shown(Path(path))}: publish needs the runs "
                                    "as flowlib.tools.run wrote them")
        shutil.copy2(folder / "params.yaml", dest / "params" / f"{label.replace('/', '__')}.yaml")
        runs[label] = shown(folder)
    if recorded:
        source = {k: summary[k] for k in ("command", "commit", "machine", "date") if k in summary}
    else:
        first = rows[0]["episodes"]
        source = {"command": "python -m flowlib.evaluate " + " ".join(shown(Path(p)) for p in paths)
                  + f" --episodes {first} --seed {summary['seed']} --run-name {src.name}",
                  "command_rebuilt": True, "commit": "not recorded"}
    save_json(dest / "record.json", {"record": record, "source": shown(src), **source,
                                     "checkpoints": [shown(Path(p)) for p in paths], "runs": runs,
                                     "published_at": git_commit()})
    return dest


def rederive(record: Path) -> list[str]:
    """Where ``record``'s ``results.csv`` differs from the rates and paired differences of its ``per_episode.csv`` (a
    2D-flows record: where its table is malformed, ``flows_2d_problems``)."""
    if (record / FLOWS_2D_TABLE).is_file():
        return flows_2d_problems(record / FLOWS_2D_TABLE)
    per_episode = pd.read_csv(record / "per_episode.csv").drop(columns="env_seed")
    derived = {r["policy"]: r for r in success_rates({c: per_episode[c].astype(bool).tolist() for c in per_episode})}
    problems = []
    for row in pd.read_csv(record / "results.csv").to_dict("records"):
        ref = derived.get(row["policy"])
        if ref is None:
            problems.append(f"{shown(record)}: row {row['policy']!r} has no column in per_episode.csv")
            continue
        for key in ("episodes", "success", "se", "diff", "diff_se"):
            if abs(float(row[key]) - float(ref[key])) > 1e-9:
                problems.append(f"{shown(record)}: {row['policy']} {key} = {row[key]} in results.csv, "
                                f"{ref[key]} from per_episode.csv")
    return problems


TABLE = re.compile(r"(?P<open><!-- (?P<kind>table|verdicts): (?P<record>[\w./-]+) -->\n)(?P<body>.*?)"
                   r"(?P<close><!-- end table -->)", re.S)  # "verdicts": a sweep's settings against its baseline
PAGES = ("README.md", "docs")  # where marked tables may be, relative to the repository


def table(record: str, root: Path = RESULTS_ROOT) -> str:
    """The markdown table of ``record``'s ``results.csv``: each policy's success, its paired difference from the first
    row and its success at the episode's end, as the results pages print them (3 decimals, ``+-`` one SE)."""
    if (root / record / FLOWS_2D_TABLE).is_file():
        return flows_2d_table(root / record / FLOWS_2D_TABLE)
    path = root / record / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"no record {record!r} under {shown(root)}: publish it with python -m flowlib.results "
                                f"publish outputs/evaluate/<run-name> --as {record}")
    rows = pd.read_csv(path).to_dict("records")
    lines = ["| policy | success_once | paired vs the first row | success_at_end |", "|---|---|---|---|"]
    for i, r in enumerate(rows):
        diff = "(reference)" if i == 0 else f"{r['diff']:+.3f} +- {r['diff_se']:.3f}"
        lines.append(f"| `{r['policy']}` | {r['success']:.3f} +- {r['se']:.3f} | {diff} | {r['success_at_end']:.3f} |")
    return "\n".join(lines) + "\n"


def flows_2d_table(path: Path) -> str:
    """Notebook 00's sliced-Wasserstein table as the results pages print it: a row per target and model, a column per
    number of steps, 3 decimals."""
    table_ = pd.read_csv(path)
    steps = flows_2d_steps(table_)
    lines = ["| target | model | " + " | ".join(steps) + " |", "|---|---|" + "---|" * len(steps)]
    for r in table_.to_dict("records"):
        lines.append(f"| {r['target']} | {r['method']} | " + " | ".join(f"{r[c]:.3f}" for c in steps) + " |")
    return "\n".join(lines) + "\n"


def pages(repo: Path = REPO_ROOT) -> list[Path]:
    out = []
    for name in PAGES:
        path = repo / name
        out += sorted(path.rglob("*.md")) if path.is_dir() else [path] if path.is_file() else []
    return out


def marked_tables(text: str, root: Path = RESULTS_ROOT) -> tuple[str, list[str]]:
    """``text`` with every marked table written from its record, and the records whose table it changed."""
    changed = []

    def fill(m):
        record = m.group("record")
        body = table(record, root) if m.group("kind") == "table" else verdicts.markdown(verdicts.effects(root / record))
        if body != m.group("body"):
            changed.append(record)
        return m.group("open") + body + m.group("close")
    return TABLE.sub(fill, text), changed


def write_tables(repo: Path = REPO_ROOT, root: Path = RESULTS_ROOT) -> list[str]:
    """Rewrite every marked table of the pages from ``root``; returns ``page: record`` for each one rewritten."""
    done = []
    for page in pages(repo):
        text, changed = marked_tables(page.read_text(), root)
        if changed:
            page.write_text(text)
            done += [f"{page.relative_to(repo)}: {r}" for r in changed]
    return done


def stale_tables(repo: Path = REPO_ROOT, root: Path = RESULTS_ROOT) -> list[str]:
    """A line per marked table that differs from its record's data (``check``)."""
    problems = []
    for page in pages(repo):
        try:
            _, changed = marked_tables(page.read_text(), root)
        except FileNotFoundError as err:
            problems.append(f"{page.relative_to(repo)}: {err}")
            continue
        problems += [f"{page.relative_to(repo)}: the table of record {r} differs from its data in results/{r}/: run "
                     "python -m flowlib.results tables" for r in changed]
    return problems


README_ROW = re.compile(r"^\| (?P<what>[^|]+) \| (?P<task>[^|]+) \| (?P<result>[^|]+) \| (?P<params>[^|]+) \| (?P<record>[^|]+) \|$")
DATA_LINK = re.compile(r"\]\((results/[\w./-]*)\)")
NUMBER = re.compile(r"(?<![\w.])[+-]?\d+\.(\d+)(?![\w.])")
RECORD_ONLY = "record only"  # a README row whose evaluation files are gone says so in its record cell


def record_values(folder: Path) -> list[float]:
    """Every rate a row may quote from the records under ``folder``: successes, their SEs, paired differences and
    their SEs, success at the episode's end, and the share of episodes where each of the task's flags was ever true
    (``*_once``: a grasp, a collision, a side passed)."""
    out = []
    for record in records(folder):
        if (record / FLOWS_2D_TABLE).is_file():  # every distance of a 2D-flows table
            table_ = pd.read_csv(record / FLOWS_2D_TABLE)
            out += [float(v) for v in table_[flows_2d_steps(table_)].to_numpy().ravel()]
            continue
        table_ = pd.read_csv(record / "results.csv")
        keys = ["success", "se", "diff", "diff_se", "success_at_end", *[c for c in table_ if c.endswith("_once")]]
        out += [float(v) for key in keys for v in table_[key]]
    return out


def readme_problems(repo: Path = REPO_ROOT, root: Path = RESULTS_ROOT) -> list[str]:
    """The README's results-at-a-glance rows against their data: a row that links ``results/...`` must quote only
    numbers its records hold (each decimal within half a unit of its last printed digit of a success, SE, paired
    difference or flag share there); a row without such a link must say ``record only`` in its record cell."""
    problems = []
    for n, line in enumerate((repo / "README.md").read_text().splitlines(), 1):
        m = README_ROW.match(line)
        if not m or m["what"].strip() in ("stage · method", "---") or set(m["what"].strip()) <= {"-"}:
            continue
        links = DATA_LINK.findall(m["record"])
        if not links:
            if RECORD_ONLY not in m["record"]:
                problems.append(f"README.md:{n}: the row {m['what'].strip()!r} links no results/ data and does not say "
                                f"{RECORD_ONLY!r}: publish its evaluation (python -m flowlib.results publish) or mark it")
            continue
        values = [v for link in links for v in record_values(root / link.removeprefix("results/"))]
        for number in NUMBER.finditer(m["result"]):
            x, tol = float(number.group(0)), 0.5 * 10 ** -len(number.group(1)) + 1e-9
            if not any(abs(x - v) <= tol for v in values):
                problems.append(f"README.md:{n}: {number.group(0)} in the row {m['what'].strip()!r} is in none of "
                                f"{', '.join(links)} (successes, SEs, paired differences)")
    return problems


def episodes(record: Path, pattern: str) -> tuple[pd.Series, pd.Series]:
    """The env seeds and per-episode success ``[N]`` of the policies of ``record`` whose label matches ``pattern``
    (``fnmatch``): one policy's, or the mean over several (a method's seeds, as one per-episode rate)."""
    per_episode = pd.read_csv(record / "per_episode.csv")
    cols = [c for c in per_episode if c != "env_seed" and fnmatch.fnmatch(c, pattern)]
    if not cols:
        raise ValueError(f"no policy of {shown(record)} matches {pattern!r}: its policies are "
                         f"{[c for c in per_episode if c != 'env_seed']}")
    return per_episode["env_seed"], per_episode[cols].astype(float).mean(axis=1)


def compare(record: Path, policy: str, against: Path, group: str) -> dict[str, float]:
    """``policy`` of ``record`` paired, episode by episode, with the mean of ``group`` of ``against`` (a method's seeds):
    both records must hold the same env seeds.  Returns the policy's success, the group's, and their paired
    difference with its SE (``metrics.paired_means``)."""
    seeds, x = episodes(record, policy)
    other_seeds, y = episodes(against, group)
    if not seeds.equals(other_seeds):
        raise ValueError(f"{shown(record)} and {shown(against)} did not run the same episodes: evaluate both with the "
                         "same --episodes and --seed")
    ref, row = paired_means({"group": y.tolist(), "policy": x.tolist()})
    return {"success": row["mean"], "group": ref["mean"], "diff": row["diff"], "diff_se": row["diff_se"]}


def records(root: Path = RESULTS_ROOT) -> list[Path]:
    return sorted(p.parent for p in root.rglob("record.json"))


def check(root: Path | None = None, repo: Path | None = REPO_ROOT) -> list[str]:
    """Every problem with ``root`` (``results/``): over the size budget, a record whose numbers do not re-derive, and
    (unless ``repo`` is None) a marked table of ``repo``'s pages that differs from its record."""
    root = RESULTS_ROOT if root is None else root
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0
    problems = [] if size <= BUDGET_BYTES else [f"{shown(root)} holds {size / 2**20:.1f} MiB, over its budget of "
                                                   f"{BUDGET_BYTES / 2**20:.0f} MiB: publish per-episode files only"]
    problems += uncompressed(root)
    for record in records(root):
        problems += rederive(record)
    return problems + (stale_tables(repo, root) + readme_problems(repo, root) if repo is not None else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowlib.results", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pub = sub.add_parser("publish", help="copy an evaluation folder and its runs' params into results/<record>/")
    pub.add_argument("folder", help="an evaluation folder, outputs/evaluate/<run-name>")
    pub.add_argument("--as", dest="record", required=True, help="the record's name under results/, e.g. metaworld/pick_place")
    pub.add_argument("--checkpoints", nargs="+", default=None,
                     help="the evaluated checkpoints, in order (only for folders written before 2026-12-06)")
    pub.add_argument("--force", action="store_true", help="replace an existing record")
    sub.add_parser("tables", help="rewrite every marked results table in the README and docs/ from results/")
    sub.add_parser("check", help="size budget, every record's numbers re-derived from its per-episode file, every "
                                 "marked table as its record gives it, the README's rows against their data")
    cmp_ = sub.add_parser("compare", help="one policy paired with the mean of a group of another record (a method's "
                                          "seeds), on the same episodes")
    cmp_.add_argument("record", help="results/<record>/ holding the policy")
    cmp_.add_argument("policy", help="its label, or a pattern matching it (*dsrl_s0*)")
    cmp_.add_argument("--against", required=True, help="results/<record>/ holding the group")
    cmp_.add_argument("--group", required=True, help="a pattern for the group's labels (*cosine_s*)")
    args = ap.parse_args(argv)
    if args.cmd == "publish":
        try:
            dest = publish(args.folder, args.record, args.checkpoints, args.force)
        except (FileNotFoundError, FileExistsError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"-> {shown(dest)}")
        return 0
    if args.cmd == "tables":
        try:
            done = write_tables()
        except FileNotFoundError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print("\n".join(done) or "every marked table is up to date")
        return 0
    if args.cmd == "compare":
        try:
            r = compare(Path(args.record), args.policy, Path(args.against), args.group)
        except (FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{args.policy}: {r['success']:.3f}; {args.group} (mean): {r['group']:.3f}; paired difference "
              f"{r['diff']:+.3f} +- {r['diff_se']:.3f}")
        return 0
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{len(records())} record(s), {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
