"""flowlib.tools.verdicts: a sweep's settings against its baseline, paired on the same episodes per training seed and
averaged over seeds; checked by hand on a made-up evaluation, and as a marked table of a results page."""
import numpy as np
import pandas as pd
import pytest

from flowlib.tools import results, verdicts


def made_up_record(folder, n=400, seeds=(0, 1, 2)):
    """A sweep evaluated on ``n`` episodes: ``baseline`` at 0.5, ``better`` = baseline plus 0.2 of the episodes,
    ``same`` = the baseline with a tenth of its episodes shuffled, ``worse`` = baseline minus 0.1; ``lonely`` has one
    seed.  ``success_at_end`` is 0.3 for all but ``better`` (0.6)."""
    rng = np.random.default_rng(0)
    cols, summary = {"env_seed": np.arange(30_000, 30_000 + n)}, []
    for s in seeds:
        base = (rng.random(n) < 0.5).astype(int)
        off = np.flatnonzero(base == 0)
        on = np.flatnonzero(base == 1)
        better, worse, same = base.copy(), base.copy(), base.copy()
        better[rng.choice(off, int(0.2 * n), replace=False)] = 1
        worse[rng.choice(on, int(0.1 * n), replace=False)] = 0
        swap = rng.choice(n, n // 10, replace=False)
        same[swap] = base[rng.permutation(swap)]
        rows = {"baseline": base, "better": better, "worse": worse, "same": same}
        if s == 0:
            rows["lonely"] = better
        for row, x in rows.items():
            label = f"toolkit/{row}_seed{s}/last.pt"
            cols[label] = x
            summary.append({"policy": label, "success": x.mean(), "success_at_end": 0.6 if row == "better" else 0.3})
    folder.mkdir(parents=True)
    pd.DataFrame(cols).to_csv(folder / "per_episode.csv", index=False)
    pd.DataFrame(summary).to_csv(folder / "results.csv", index=False)
    return pd.DataFrame(cols)


def test_labels_parse_into_setting_and_seed():
    assert verdicts.parse("toolkit/adv_mc_seed2/last.pt") == ("adv_mc", 2)
    assert verdicts.parse("toolkit/grad_clip_0.5_seed10/best_model.pt@K1") == ("grad_clip_0.5@K1", 10)
    assert verdicts.parse("01_shortcut_bc/start/best_model.pt") is None


def test_effects_pair_each_seed_with_the_baselines_and_judge_by_two_se(tmp_path):
    episodes = made_up_record(tmp_path / "rec")
    table = verdicts.effects(tmp_path / "rec").set_index("setting")
    assert list(table.index)[0] == "baseline" and table.loc["baseline", "verdict"] == "(reference)"
    assert table.loc["better", "effect"] == pytest.approx(0.2) and table.loc["better", "verdict"] == "helps"
    assert table.loc["worse", "effect"] == pytest.approx(-0.1) and table.loc["worse", "verdict"] == "hurts"
    assert table.loc["same", "verdict"] == "no effect"
    assert table.loc["lonely", "verdict"] == "provisional (1 seed)" and table.loc["lonely", "seeds"] == 1
    # by hand, for "same": per-seed paired means and SEs, then the rule's SE
    d = [(episodes[f"toolkit/same_seed{s}/last.pt"] - episodes[f"toolkit/baseline_seed{s}/last.pt"]) for s in range(3)]
    means, ses = [x.mean() for x in d], [x.std(ddof=1) / np.sqrt(len(x)) for x in d]
    se = max(np.std(means, ddof=1) / np.sqrt(3), np.sqrt(np.sum(np.square(ses))) / 3)
    assert table.loc["same", "effect"] == pytest.approx(np.mean(means))
    assert table.loc["same", "effect_se"] == pytest.approx(se)
    assert table.loc["better", "end_effect"] == pytest.approx(0.3) and table.loc["better", "end_verdict"] == "helps"
    with pytest.raises(ValueError, match="no 'control' row"):
        verdicts.effects(tmp_path / "rec", baseline="control")


def test_a_verdicts_table_is_written_from_its_record_and_a_changed_digit_is_caught(tmp_path):
    root, repo = tmp_path / "results", tmp_path / "repo"
    made_up_record(root / "toolkit" / "demo")
    (repo / "docs").mkdir(parents=True)
    page = repo / "docs" / "page.md"
    page.write_text("<!-- verdicts: toolkit/demo -->\n| stale |\n<!-- end table -->\n")
    assert len(results.stale_tables(repo, root)) == 1
    assert results.write_tables(repo, root) == ["docs/page.md: toolkit/demo"]
    text = page.read_text()
    assert "| `better` | 3 | 0.685 | +0.200 +- 0.012 | helps |" in text and "| helps |" in text and results.stale_tables(repo, root) == []
    page.write_text(text.replace("+0.200", "+0.300"))
    assert len(results.stale_tables(repo, root)) == 1
