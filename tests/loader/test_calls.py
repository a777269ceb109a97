"""The fetcher's calls at once: a table of short windows given by hand, and the limit after each.

Each row gives :func:`decide_calls` how the consumer took its last batches and one window
(2 cores, at most 64 calls), and the calls at once it must set. ``test_loader.py`` runs real
datasets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from feedline.loader._calls import FED_BATCHES, CallsSample, CallsState, decide_calls


@dataclass(frozen=True)
class CallsCase:
    """One row: how the consumer took its last batches, a window, the calls at once after it.

    ``took`` is one letter per batch: ``c`` found ready while the consumer computed, ``s``
    found ready while it slept, ``w`` waited for. ``to`` is the limit after the window
    (``why`` names the rule, ``""``: as it was).
    """

    name: str
    sample: CallsSample
    to: int
    why: str = ""
    took: str = ""
    low: int = 1


CALLS_CASES = [
    # -- calls that wait on I/O: more --------------------------------------------------------------
    CallsCase(
        "idle cores, calls waiting: a quarter more", CallsSample(8, 0.7, 0.0, 40), 10, "wait"
    ),
    CallsCase("at least one more", CallsSample(3, 0.7, 0.0, 40), 4, "wait"),
    CallsCase("cores under half busy: twice as many", CallsSample(8, 0.2, 0.0, 40), 16, "wait"),
    CallsCase("the slow start doubles", CallsSample(3, 0.7, 0.0, 40, starting=True), 6, "wait"),
    CallsCase("not past the pool's threads", CallsSample(48, 0.2, 0.0, 40), 64, "wait"),
    CallsCase("not without calls waiting to start", CallsSample(8, 0.2, 0.0, 0), 8),
    CallsCase("not on cores that are mostly busy", CallsSample(8, 0.88, 0.0, 40), 8),
    CallsCase(
        # Other processes on the cores make this one look idle; the running calls show it.
        "not while more calls than cores run on them",
        CallsSample(8, 0.4, 0.0, 40, on_cores=6, running=8),
        8,
    ),
    CallsCase(
        "calls that wait and compute, a few on the cores, still get more",
        CallsSample(8, 0.6, 0.0, 40, on_cores=2, running=8),
        10,
        "wait",
    ),
    # -- calls that compute: fewer -----------------------------------------------------------------
    CallsCase("busy cores: a fifth fewer", CallsSample(10, 0.95, 0.0, 40), 8, "cores full"),
    CallsCase("not below cores + 1", CallsSample(4, 0.95, 0.0, 40), 3, "cores full"),
    CallsCase("nor below its bound", CallsSample(8, 0.95, 0.0, 40), 7, "cores full", low=7),
    CallsCase(
        "calls that queue for a core: fewer, however idle this process looks",
        CallsSample(10, 0.5, 0.4, 40),
        8,
        "cores full",
    ),
    # -- a consumer that computes keeps a core -----------------------------------------------------
    CallsCase(
        "a fed consumer: calls that compute keep to the other cores",
        CallsSample(3, 0.95, off_cores=0.1),
        1,
        "consumer computes",
        took="ccc",
    ),
    CallsCase(
        "not before it found three batches ready",
        CallsSample(3, 0.95, off_cores=0.1),
        3,
        "cores full",
        took="cc",
    ),
    CallsCase(
        "not for calls that wait", CallsSample(8, 0.7, 0.0, 40, off_cores=0.6), 10, "wait", "ccc"
    ),
    CallsCase(
        "not for a consumer that sleeps",
        CallsSample(3, 0.95, off_cores=0.1),
        3,
        "cores full",
        "sss",
    ),
    CallsCase("not once it waited", CallsSample(3, 0.95, off_cores=0.1), 3, "cores full", "cccw"),
]


def _play_calls(case: CallsCase) -> tuple[int, str]:
    state, limit = CallsState(cores=2, low=case.low, high=64), case.sample.limit
    for letter in case.took:
        state, limit = state.took(letter == "w", 0.9 if letter == "c" else 0.1, limit)
    return decide_calls(state, dataclasses.replace(case.sample, limit=limit))


@pytest.mark.parametrize("case", CALLS_CASES, ids=[c.name for c in CALLS_CASES])
def test_calls_decisions(case: CallsCase) -> None:
    to, why = _play_calls(case)
    assert to == case.to, why
    assert case.why in why if case.why else why == "", why


def test_every_calls_rule_has_a_row() -> None:
    whys = {_play_calls(case)[1] for case in CALLS_CASES}
    for reason in ("calls wait", "cores full", "consumer computes"):
        assert any(reason in why for why in whys), reason
    assert "" in whys  # and rows where nothing changes


def test_a_consumer_no_longer_fed_gives_the_cores_back_at_once() -> None:
    state, limit = CallsState(cores=2, high=64), 1
    for _ in range(FED_BATCHES):
        state, limit = state.took(False, 0.9, limit)
    assert state.fed
    assert state.took(False, 0.1, 1) == (CallsState(cores=2, high=64), 3)  # it sleeps now
    assert state.took(True, None, 1)[1] == 3  # it waited for a batch
    assert state.took(True, None, 12)[1] == 12  # already more: kept


def test_the_first_calls_are_the_cores_and_a_spare_in_the_pipeline() -> None:
    state = CallsState(cores=2, low=1, high=64)
    assert (state.first(None, spare=1), state.first(None, spare=0), state.first(5, 0)) == (3, 2, 5)
    assert CallsState(cores=2, low=4).first(None, spare=1) == 4
