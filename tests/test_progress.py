"""The launcher's progress display: plain streamed lines off a terminal, a live bar of the rounds on one."""

from __future__ import annotations

import io

from rich.console import Console

from pollen.launch.progress import RunProgress, parse_round, wants_live

ROUND = "[pollen] round {k}/{n} | accuracy 0.5000 | 1.2s | elapsed {k}s, ETA 8s\n"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_round_lines_are_recognised_and_nothing_else():
    assert parse_round(ROUND.format(k=3, n=10)) == (3, 10)
    assert parse_round("INFO :      [ROUND 3/10]\n") is None  # Flower's own line is not ours
    assert parse_round("[pollen] run folder /tmp/x\n") is None


def test_live_only_on_an_interactive_terminal_unless_asked_plain():
    assert not wants_live(io.StringIO(), env={})
    assert wants_live(Terminal(), env={})
    assert not wants_live(Terminal(), env={"POLLEN_PROGRESS": "plain"})
    assert not wants_live(Terminal(), env={"TERM": "dumb"})


def test_off_a_terminal_the_lines_pass_through_unchanged():
    out = io.StringIO()
    lines = ["[pollen] round 1/2 | x\n", "some flower line\n", ROUND.format(k=2, n=2)]
    with RunProgress(stream=out) as progress:
        for line in lines:
            progress.line(line)
    assert out.getvalue() == "".join(lines)  # no control characters in a log file


def test_on_a_terminal_a_bar_counts_the_rounds_below_the_lines():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=160, color_system=None)
    with RunProgress(live=True, stream=screen, console=console) as progress:
        progress.line("[pollen] SuperLink up\n")
        progress.line(ROUND.format(k=4, n=10))  # a resumed run: its first round here is 4
        progress.line(ROUND.format(k=5, n=10))
        rounds = progress._progress.tasks[1]
        assert (rounds.completed, rounds.total, rounds.description) == (5, 10, "rounds")
        assert progress._progress.tasks[0].description == "start-up"
    shown = screen.getvalue()
    assert "[pollen] SuperLink up" in shown and "round 5/10" in shown
    assert "5/10" in shown.split("round 5/10")[-1]  # the bar's own k/N after the last line


def test_the_console_gets_pollen_lines_and_warnings_and_run_log_gets_everything(tmp_path, capsys):
    """One line per round by default: Flower's INFO lines only in run.log (and on the console with
    --verbose); WARNINGs and ERRORs always shown; what the launcher prints is copied to run.log, without
    terminal colours, and a second launch appends."""
    from pollen.launch.console import RunLog, on_console

    flower_info = "\x1b[92mINFO \x1b[0m:      [ROUND 2/5]\n"
    warning = "\x1b[93mWARNING \x1b[0m:   round 2 train: partition 1 failed\n"
    ours = ROUND.format(k=2, n=5)
    assert [on_console(x) for x in (flower_info, warning, ours)] == [False, True, True]
    assert on_console(flower_info, verbose=True)
    log_path = tmp_path / "run.log"
    with RunLog(log_path) as log:
        print("[pollen] SuperLink up on port 1234")
        for line in (flower_info, warning, ours):
            log.record(line)
            if on_console(line):
                log.console.write(line)
    with RunLog(log_path):
        print("[pollen] run folder again")
    out = capsys.readouterr().out
    assert out == "[pollen] SuperLink up on port 1234\n" + warning + ours + "[pollen] run folder again\n"
    text = log_path.read_text()
    assert text.startswith("[pollen] SuperLink up on port 1234\nINFO :      [ROUND 2/5]\nWARNING :   round 2")
    assert ours in text and "launched again ---\n[pollen] run folder again\n" in text and "\x1b[" not in text
