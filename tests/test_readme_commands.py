"""README's expected results are the recorded results of README's own commands, run as written.

``bench/readme_commands.py`` runs each command of "One command per family" and writes
``bench/results/readme_commands/<family>.json``; README's table is rendered from those files. These tests
fail when the table is edited by hand, when a command changes without being run again, or when a
recorded run did not complete.
"""

from __future__ import annotations

from bench.readme_commands import LABEL, OUT, README, expected_result, readme_commands, records, render_readme


def test_every_family_has_one_command_in_the_readme():
    commands = readme_commands()
    assert set(commands) == set(LABEL)
    assert all(c.startswith("pollen run ") for c in commands.values()), commands
    assert "method='bd-fedproto'" in commands["bd-fedproto"] and "method='fedproto'" in commands["fedproto"]


def test_the_readme_table_is_the_one_the_recorded_runs_give():
    text = README.read_text()
    assert render_readme(text, records()) == text, "run `python -m bench.readme_commands --table`"


def test_each_recorded_run_is_of_the_command_the_readme_prints_now_and_completed():
    commands = readme_commands()
    for family, rec in records().items():
        assert rec["command"] == commands[family], f"{family}: README's command changed since {OUT / family}.json"
        assert rec["summary"]["status"] == "completed", family
        assert expected_result(family, rec["summary"])  # the figure the table quotes can be read
