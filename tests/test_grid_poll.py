"""pollen.app.grid_poll: a deployment grid hands replies over as they arrive, and keeps Flower's semantics
(every reply, or what came before the timeout)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from flwr.superlink.grid import HttpGrid

from pollen.app.grid_poll import prompt_replies
from pollen.testing import InProcessGrid


def _grid(answer_after: float, answered: set[str]) -> HttpGrid:
    """An HttpGrid (never connected) whose messages ``answered`` get their reply ``answer_after`` s after the push."""
    grid = HttpGrid(token="t")
    pushed: dict[str, float] = {}

    def push_messages(messages):
        ids = [str(m) for m in messages]
        pushed.update(dict.fromkeys(ids, time.monotonic()))
        return ids

    def pull_messages(ids):
        ready = [i for i in ids if i in answered and time.monotonic() - pushed[i] >= answer_after]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in ready]

    grid.push_messages = push_messages
    grid.pull_messages = pull_messages
    return prompt_replies(grid)


def test_replies_are_taken_as_they_arrive_not_at_a_3_second_tick():
    grid = _grid(0.3, {"a", "b"})
    assert type(grid) is HttpGrid
    began = time.monotonic()
    replies = grid.send_and_receive(["a", "b"], timeout=None)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["a", "b"]
    assert time.monotonic() - began < 1.5  # Flower's own loop: 3 s


def test_a_timeout_returns_what_came_and_does_not_sleep_past_it():
    grid = _grid(0.1, {"a"})
    began = time.monotonic()
    replies = grid.send_and_receive(["a", "never"], timeout=1.0)
    waited = time.monotonic() - began
    assert [r.metadata.reply_to_message_id for r in replies] == ["a"]
    assert 1.0 <= waited < 1.5, waited  # Flower's own loop: 3 s


def test_other_grids_are_left_as_they_are():
    grid = InProcessGrid({})
    assert prompt_replies(grid) is grid and "send_and_receive" not in vars(grid)
