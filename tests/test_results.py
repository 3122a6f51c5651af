"""Results as data (flowlib.tools.results): publish copies an evaluation and its runs' parameters into results/<record>/,
refuses what is not an evaluation, and check re-derives every committed number from its per-episode file."""
import gzip
import json

import pandas as pd
import pytest

from flowlib.tools import evaluate, results


def fake_evaluation(outputs, name="pair", with_source=True):
    """Two runs (a stage-1 best_model.pt and a stage-3 last.pt) and an evaluation of both on 4 episodes."""
    ckpts = []
    for folder, file in [("01_shortcut_bc/start", "best_model.pt"), ("03_reinflow/tuned_s0", "last.pt")]:
        run = outputs / folder
        run.mkdir(parents=True)
        (run / "params.yaml").write_text(f"run_name: {run.name}\nseed: 0\n")
        (run / file).write_bytes(b"not a checkpoint")
        ckpts.append(run / file)
    outcomes = {"start/best_model.pt": [1, 0, 0, 1], "tuned_s0/last.pt": [1, 1, 1, 1]}
    res = {k: {"per_episode_success_once": [bool(x) for x in v], "per_episode_return": [float(x) for x in v],
               "success_at_end": 0.5, "act_horizon": 8} for k, v in outcomes.items()}
    src = outputs / "evaluate" / name
    src.mkdir(parents=True)
    source = {"command": "python -m flowlib.evaluate ...", "commit": "abc123", "machine": "a CPU",
              "checkpoints": [str(p) for p in ckpts]} if with_source else None
    evaluate.write_report(src, res, 30000, source)
    return src, ckpts


@pytest.fixture
def roots(tmp_path, monkeypatch):
    outputs = tmp_path / "outputs"
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(outputs))
    monkeypatch.setattr(results, "RESULTS_ROOT", tmp_path / "results")
    return outputs, tmp_path / "results"


def test_publish_copies_the_evaluation_the_runs_params_and_where_it_came_from(roots):
    outputs, root = roots
    src, _ = fake_evaluation(outputs)
    assert results.main(["publish", str(src), "--as", "demo/pair"]) == 0
    dest = root / "demo" / "pair"
    assert {p.name for p in dest.iterdir()} == {"results.csv", "per_episode.csv", "per_episode_return.csv.gz",
                                                "per_episode_flags.csv.gz", "summary.json", "record.json", "params"}
    assert sorted(p.name for p in (dest / "params").iterdir()) == ["start__best_model.pt.yaml",
                                                                   "tuned_s0__last.pt.yaml"]
    record = json.loads((dest / "record.json").read_text())
    assert record["commit"] == "abc123" and record["command"].startswith("python -m flowlib.evaluate")
    assert results.check(root, repo=None) == []
    with pytest.raises(FileExistsError, match="--force"):
        results.publish(src, "demo/pair")


def test_publish_gzips_the_other_per_episode_files_reproducibly_and_check_refuses_them_plain(roots):
    outputs, root = roots
    src, _ = fake_evaluation(outputs)
    dest = results.publish(src, "demo/pair")
    packed = (dest / "per_episode_return.csv.gz").read_bytes()
    assert gzip.decompress(packed) == (src / "per_episode_return.csv").read_bytes()
    assert pd.read_csv(dest / "per_episode_flags.csv.gz").equals(pd.read_csv(src / "per_episode_flags.csv"))
    results.publish(src, "demo/pair", force=True)
    assert (dest / "per_episode_return.csv.gz").read_bytes() == packed  # no time or name in the header
    (dest / "per_episode_return.csv").write_bytes(gzip.decompress(packed))
    [problem] = results.check(root, repo=None)
    assert "per_episode_return.csv is not gzipped" in problem


def test_publish_refuses_a_folder_that_is_not_an_evaluation_and_checkpoints_that_are_not_its_own(roots):
    outputs, _ = roots
    (outputs / "03_reinflow" / "run").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not an evaluation folder"):
        results.publish(outputs / "03_reinflow" / "run", "x")
    src, ckpts = fake_evaluation(outputs, with_source=False)  # written before evaluate recorded its checkpoints
    with pytest.raises(ValueError, match="--checkpoints"):
        results.publish(src, "old")
    with pytest.raises(ValueError, match="scored"):
        results.publish(src, "old", [str(ckpts[1]), str(ckpts[0])])  # another order: other labels
    dest = results.publish(src, "old", [str(p) for p in ckpts])
    record = json.loads((dest / "record.json").read_text())
    assert record["command_rebuilt"] and record["commit"] == "not recorded" and "--seed 30000" in record["command"]


def test_check_names_the_file_and_row_whose_number_drifted_from_its_episodes(roots):
    outputs, root = roots
    dest = results.publish(fake_evaluation(outputs)[0], "demo/pair")
    csv = dest / "results.csv"
    csv.write_text(csv.read_text().replace("0.5,", "0.6,", 1))  # start's success 0.5 -> 0.6
    [problem] = results.check(root, repo=None)
    assert "start/best_model.pt success = 0.6 in results.csv, 0.5 from per_episode.csv" in problem


def test_the_committed_results_keep_their_budget_and_every_number_re_derives():
    assert results.check() == []


HAND_WRITTEN = """| policy | success_once | paired vs the first row | success_at_end |
|---|---|---|---|
| `start/best_model.pt` | 0.500 +- 0.250 | (reference) | 0.500 |
| `tuned_s0/last.pt` | 1.000 +- 0.000 | +0.500 +- 0.289 | 0.500 |
"""


def test_a_marked_table_is_written_from_its_record_and_a_changed_digit_is_caught(roots, tmp_path):
    outputs, root = roots
    results.publish(fake_evaluation(outputs)[0], "demo/pair")
    assert results.table("demo/pair", root) == HAND_WRITTEN
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    page = repo / "docs" / "page.md"
    page.write_text("Before.\n\n<!-- table: demo/pair -->\n| stale |\n<!-- end table -->\n\nAfter.\n")
    assert results.stale_tables(repo, root) == ["docs/page.md: the table of record demo/pair differs from "
                                                "its data in results/demo/pair/: run python -m flowlib.results tables"]
    assert results.write_tables(repo, root) == ["docs/page.md: demo/pair"]
    assert page.read_text() == f"Before.\n\n<!-- table: demo/pair -->\n{HAND_WRITTEN}<!-- end table -->\n\nAfter.\n"
    assert results.stale_tables(repo, root) == []
    page.write_text(page.read_text().replace("0.500 +- 0.250", "0.600 +- 0.250"))  # one digit
    assert len(results.stale_tables(repo, root)) == 1
    page.write_text(page.read_text().replace("demo/pair", "demo/gone"))
    with pytest.raises(FileNotFoundError, match="publish"):
        results.table("demo/gone", root)
    assert "no record 'demo/gone'" in results.stale_tables(repo, root)[0]


def test_a_readme_row_is_checked_against_the_records_it_links(roots, tmp_path):
    """A results row that links results/ data quotes only numbers its records hold (a digit changed is caught,
    naming the line and the number); a row without data must say it is record only."""
    outputs, root = roots
    results.publish(fake_evaluation(outputs)[0], "demo/pair")  # successes 0.5 and 1.0, paired +0.5
    row = "| 3 · tuned | Demo | 0.50 -> **1.00** (+0.500) | `x.yaml` | [page](docs/p.md), [data](results/demo/) |\n"
    assert readme_problems(tmp_path, root, row) == []
    assert readme_problems(tmp_path, root, row.replace("**1.00**", "**0.99**")) == [
        "README.md:3: 0.99 in the row '3 · tuned' is in none of results/demo/ (successes, SEs, paired differences)"]
    assert "links no results/ data and does not say 'record only'" in readme_problems(
        tmp_path, root, row.replace(", [data](results/demo/)", ""))[0]
    assert readme_problems(tmp_path, root, row.replace(", [data](results/demo/)", " · record only")) == []


def readme_problems(tmp_path, root, row):
    """``results.readme_problems`` of a README holding the results table's header and ``row``."""
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    header = "| stage · method | task | result | params | record |\n|---|---|---|---|---|\n"
    (repo / "README.md").write_text(header + row)
    return results.readme_problems(repo, root)


def test_compare_pairs_a_policy_with_a_groups_mean_on_the_same_episodes(roots, tmp_path):
    outputs, root = roots
    rec = results.publish(fake_evaluation(outputs)[0], "demo/pair")  # start [1,0,0,1], tuned [1,1,1,1]
    r = results.compare(rec, "tuned*", rec, "*")  # against the mean of both: [1, .5, .5, 1]
    assert r["success"] == 1.0 and r["group"] == 0.75 and r["diff"] == 0.25
    assert abs(r["diff_se"] - 0.1443376) < 1e-6  # std([0, .5, .5, 0], ddof=1) / sqrt(4)
    with pytest.raises(ValueError, match="no policy of .* matches 'nothing\\*'"):
        results.compare(rec, "nothing*", rec, "*")
    other = tmp_path / "other"
    other.mkdir()
    (other / "per_episode.csv").write_text("env_seed,x\n1,1\n2,1\n3,0\n4,0\n")
    with pytest.raises(ValueError, match="did not run the same episodes"):
        results.compare(rec, "tuned*", other, "x")


def fake_flows_2d_run(outputs, name="default"):
    """Notebook 00's run folder: its sliced-Wasserstein table (as ``DataFrame.to_csv`` writes it), params and
    provenance."""
    run = outputs / "00_flows_2d" / name
    run.mkdir(parents=True)
    pd.DataFrame({"target": ["two_moons"] * 3, "method": ["data (floor)", "reflow", "shortcut"],
                  "1 step": [0.031, 1.092, 0.107], "8 steps": [0.031, 0.123, 0.081]}).to_csv(
        run / "sliced_wasserstein.csv", index=False)
    (run / "params.yaml").write_text(f"seed: 0\nrun_name: {name}\n")
    (run / "provenance.json").write_text(json.dumps({"command": "python -m flowlib.run 00_flows_2d", "commit": "abc123",
                                                     "machine": "a CPU", "date": "2026-12-07 23:00 UTC"}))
    return run


def test_a_2d_flows_run_is_published_with_its_table_params_and_the_command_that_remakes_it(roots, tmp_path):
    outputs, root = roots
    dest = results.publish(fake_flows_2d_run(outputs), "stage0/default")
    assert {p.name for p in dest.iterdir()} == {"sliced_wasserstein.csv", "params", "record.json"}
    record = json.loads((dest / "record.json").read_text())
    assert record["commit"] == "abc123" and record["machine"] == "a CPU"
    assert record["command"].endswith("00_flows_2d --params " + str(dest / "params" / "default.yaml"))
    assert results.check(root, repo=None) == []
    assert results.table("stage0/default", root) == (
        "| target | model | 1 step | 8 steps |\n|---|---|---|---|\n| two_moons | data (floor) | 0.031 | 0.031 |\n"
        "| two_moons | reflow | 1.092 | 0.123 |\n| two_moons | shortcut | 0.107 | 0.081 |\n")
    row = "| 0 · ShortCut vs ReFlow | 2D | sliced W 0.107 vs 1.092 | default | [data](results/stage0/) |\n"
    assert readme_problems(tmp_path, root, row) == []
    assert "1.093 in the row '0 · ShortCut vs ReFlow'" in readme_problems(tmp_path, root, row.replace("1.092", "1.093"))[0]


def test_a_malformed_2d_table_is_refused_at_publish_and_caught_by_check(roots):
    outputs, root = roots
    run = fake_flows_2d_run(outputs)
    table = run / "sliced_wasserstein.csv"
    good = table.read_text()
    table.write_text(good.replace("0.123", "nan"))
    with pytest.raises(ValueError, match="two_moons / reflow has a distance that is not finite"):
        results.publish(run, "stage0/default")
    table.write_text(good)
    dest = results.publish(run, "stage0/default")
    (dest / "sliced_wasserstein.csv").write_text("\n".join(line for line in good.splitlines() if "floor" not in line))
    assert results.check(root, repo=None) == [
        f"{results.shown(dest / 'sliced_wasserstein.csv')}: target two_moons has no 'data (floor)' row"]
    (run / "params.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="no params.yaml"):
        results.publish(run, "stage0/other")
