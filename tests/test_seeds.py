"""python -m flowlib.seeds: a result over seeds from flowlib.tools.evaluate folders, and the clustered SE it pools with."""
import json

import numpy as np
import pytest

from flowlib.infra.metrics import clustered_mean
from flowlib.infra.runs import run_dir
from flowlib.tools import evaluate, seeds


def test_clustered_se_is_the_plain_se_for_singletons_and_one_seeds_se_for_copies():
    x = (np.random.default_rng(0).random(200) < 0.7).astype(float)
    mean, se = clustered_mean(x, np.arange(200))
    assert mean == pytest.approx(x.mean()) and se == pytest.approx(x.std(ddof=1) / np.sqrt(200))
    # three seeds that fail on exactly the same episodes carry one seed's information, not three
    assert clustered_mean(np.tile(x, 3), np.tile(np.arange(200), 3))[1] == pytest.approx(se)


def test_clustered_se_of_balanced_clusters_is_the_se_of_their_means():
    rng = np.random.default_rng(1)
    x = rng.random((50, 4))                       # [C, S]: 4 correlated samples in each of 50 clusters
    x += rng.normal(size=(50, 1))
    mean, se = clustered_mean(x.ravel(), np.repeat(np.arange(50), 4))
    assert mean == pytest.approx(x.mean())
    assert se == pytest.approx(x.mean(1).std(ddof=1) / np.sqrt(50))
    with pytest.raises(ValueError, match="at least 2 clusters"):
        clustered_mean(x.ravel(), np.zeros(200))
    with pytest.raises(ValueError, match="one length"):
        clustered_mean(x.ravel(), np.arange(10))


def fake_evaluation(name: str, outcomes: dict[str, list[int]], seed: int = 30000):
    """An outputs/evaluate/<name>/ folder as flowlib.tools.evaluate writes it, for these per-episode successes."""
    results = {label: {"per_episode_success_once": [bool(o) for o in x], "per_episode_return": [float(o) for o in x],
                       "success_at_end": float(np.mean(x)), "act_horizon": 8,
                       "flags_once": {"is_grasped": 1.0}, "per_episode_flags_once": {"is_grasped": [True] * len(x)}}
               for label, x in outcomes.items()}
    evaluate.write_report(run_dir("evaluate", name), results, seed)


@pytest.fixture
def two_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIB_OUTPUTS", str(tmp_path))
    hard = [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]  # every seed fails the first two episodes
    fake_evaluation("a", {"start_a/best_model.pt": [0, 0, 1, 0, 1, 0, 1, 0, 1, 1],
                          "s1/last.pt": hard, "s1/best_model.pt": [1] * 10, "s2/last.pt": hard})
    fake_evaluation("b", {"start_b/best_model.pt": [0, 0, 0, 0, 1, 1, 1, 1, 1, 1],
                          "s3/last.pt": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0]})
    return tmp_path


def test_seeds_report_lines_spread_and_pooled_rate(two_starts, capsys):
    assert seeds.main(["a", "b", "--policy", "last.pt", "--target", "0.8", "--name", "t"]) == 0
    summary = json.loads((two_starts / "seeds" / "t" / "summary.json").read_text())
    rates = np.array([0.8, 0.8, 0.7])  # s1, s2, s3
    assert summary["seeds"] == 3 and summary["mean"] == pytest.approx(rates.mean())
    assert summary["std"] == pytest.approx(rates.std(ddof=1))
    assert summary["gain_mean"] == pytest.approx(np.mean([0.8 - 0.5, 0.8 - 0.5, 0.7 - 0.6]))  # each over its own start
    assert summary["at_or_above_target"] == 2
    assert (summary["pooled_successes"], summary["pooled_episodes"]) == (23, 30)
    # the shared failures make the episode-clustered SE wider than a binomial over 30 independent episodes
    assert summary["pooled_se_clustered"] > 1.2 * summary["pooled_se_binomial"]
    lines = (two_starts / "seeds" / "t" / "seeds.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in lines[1:]] == ["s1/last.pt", "s2/last.pt", "s3/last.pt"]  # not best_model
    assert "start_b/best_model.pt" in lines[3]
    assert "pooled 23 / 30" in capsys.readouterr().out


def test_seeds_report_rejects_what_it_cannot_pool(two_starts, capsys):
    assert seeds.main(["nowhere"]) == 2
    err = capsys.readouterr().err
    assert "nowhere is not an evaluation folder" in err and "python -m flowlib.evaluate" in err
    assert seeds.main(["a", "--policy", "final.pt"]) == 2
    assert "has no checkpoint 'final.pt'" in capsys.readouterr().err
    assert seeds.main(["a", "a"]) == 2
    assert "pass each seed once" in capsys.readouterr().err
    assert seeds.main(["b", "--policy", "last.pt"]) == 2
    assert "at least 2 seeds" in capsys.readouterr().err
