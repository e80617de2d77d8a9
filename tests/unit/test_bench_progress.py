"""flowq bench's progress: a line per scenario, a line per repeat, a redrawn bar on a TTY."""

from __future__ import annotations

from flowq_bench.progress import BAR_WIDTH, Progress, repeats, reporting


def test_a_line_per_scenario_and_per_repeat_off_a_terminal() -> None:
    said: list[str] = []
    with reporting(Progress(said.append, scenarios=2)) as progress:
        progress.scenario("drain")
        assert list(repeats(2, "flowq noop C=16")) == [0, 1]
        progress.scenario("enqueue")
    assert "".join(said) == ("[1/2] running drain …\n  flowq noop C=16: run 1/2\n"
                             "  flowq noop C=16: run 2/2\n[2/2] running enqueue …\n")


def test_a_bar_redrawn_in_place_on_a_terminal() -> None:
    said: list[str] = []
    with reporting(Progress(said.append, tty=True, scenarios=1)) as progress:
        progress.scenario("drain")
        list(repeats(2, "raw batched"))
    text = "".join(said)
    assert text.count("\n") == 2  # the scenario's line, and the bar's once it is done
    assert f"\r  raw batched [{'-' * BAR_WIDTH}] 1/2" in text
    assert f"[{'#' * (BAR_WIDTH // 2)}{'-' * (BAR_WIDTH // 2)}] 2/2" in text


def test_nothing_is_reported_outside_a_run() -> None:
    assert list(repeats(3, "alone")) == [0, 1, 2]
