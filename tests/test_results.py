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
                                                "results/demo/pair/results.csv: run python -m flowlib.results tables"]
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
    repo = tmp_path / "repo"
    repo.mkdir()
    header = "| stage · method | task | result | params | record |\n|---|---|---|---|---|\n"
    row = "| 3 · tuned | Demo | 0.50 -> **1.00** (+0.500) | `x.yaml` | [page](docs/p.md), [data](results/demo/) |\n"
    (repo / "README.md").write_text(header + row)
    assert results.readme_problems(repo, root) == []
    (repo / "README.md").write_text(header + row.replace("**1.00**", "**0.99**"))
    assert results.readme_problems(repo, root) == [
        "README.md:3: 0.99 in the row '3 · tuned' is in none of results/demo/ (successes, SEs, paired differences)"]
    (repo / "README.md").write_text(header + row.replace(", [data](results/demo/)", ""))
    assert "links no results/ data and does not say 'record only'" in results.readme_problems(repo, root)[0]
    (repo / "README.md").write_text(header + row.replace(", [data](results/demo/)", " · record only"))
    assert results.readme_problems(repo, root) == []


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
