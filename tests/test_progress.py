"""Progress in a headless run: one plain line per update interval, no carriage returns, the count in each."""
import re

from flowlib.infra import progress


def test_a_headless_bar_prints_plain_lines_with_the_count_rate_and_eta(monkeypatch, capsys):
    monkeypatch.setenv(progress.PROGRESS_ENV, progress.LINES)
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0)
    assert progress.mode() == progress.LINES
    bar = progress.bar(3, "training", unit="step")
    for _ in range(3):
        bar.update()
    bar.close()
    out = capsys.readouterr().out
    assert "\r" not in out and "\x1b" not in out
    lines = out.splitlines()
    assert [line.split(" [")[0] for line in lines] == [f"training: {n}/3" for n in range(4)]  # no repeat at close
    assert all(re.search(r"\[\d\d:\d\d<[\d:?]+, +[\d.?]+ ?step/s\]$", line) for line in lines)


def test_a_headless_bar_waits_its_interval_between_lines_and_a_short_passing_one_prints_nothing(monkeypatch, capsys):
    monkeypatch.setenv(progress.PROGRESS_ENV, progress.LINES)
    bar = progress.bar(1000, "training", unit="step")
    for _ in range(999):
        bar.update()
    assert capsys.readouterr().out.splitlines() == ["training: 0/1000 [00:00<?, ?step/s]"]  # then nothing for 15 s
    bar.close()
    assert capsys.readouterr().out.startswith("training: 999/1000")  # where it ended
    evaluation = progress.bar(1000, "evaluating", unit="episode", leave=False)  # a quick evaluation inside a run
    evaluation.update(1000)
    evaluation.close()
    assert capsys.readouterr().out == ""
