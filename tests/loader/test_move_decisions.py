"""The rule of ``num_workers="auto"`` (``_move.decide``), as a table of windows and decisions.

Each row is one window as the consumer measured it, whether a trial is under way (the rate
before it), whether one may be made, and the action and worker processes expected. Breaking
any one clause of the rule fails a row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from feedline._retry import RETRY_AFTER, RETRY_MOST
from feedline.loader._move import (
    KEEP_GAIN,
    MIN_BATCHES,
    SKIP_BATCHES,
    TRIAL_BATCHES,
    TRIAL_SECONDS,
    TRIAL_SKIP,
    Placement,
    Sample,
    Window,
    decide,
)


@dataclass(frozen=True)
class Row:
    name: str
    sample: Sample
    action: str
    workers: int = 0
    trial_rate: float | None = None
    may_try: bool = True
    asked: Sample | None = None  # the window before, if it asked for a trial (see ROWS)


def window(**fields: float | int | None) -> Sample:
    """A steady window on threads of a 4-core process: 40 batches in a second."""
    base: dict[str, float | int | None] = {
        "workers": 0,
        "batches": 40,
        "seconds": 1.0,
        "waited": 0.0,
        "slept": 0.0,
        "loader_cores": 0.8,
        "cores": 4,
        "idle": 2.0,
        "between": 0.025,
    }
    base.update(fields)
    return Sample(**base)  # type: ignore[arg-type]


ASKED = window(batches=30, slept=0.05)
"""A window before that asked for a trial: 30 batches in a second."""


ROWS = [
    Row(
        "the first window that asks for a trial only asks: the next must ask too",
        window(slept=0.08),
        "ask",
        workers=2,
    ),
    Row(
        "the second window that asks moves",
        window(slept=0.08),
        "move",
        workers=2,
        asked=ASKED,
    ),
    Row(
        "a first window whose thread sleeps three times the bounds moves at once",
        window(slept=0.3),
        "move",
        workers=2,
    ),
    Row(
        "a first window three times the share, but not three times the ms a batch, only asks",
        window(batches=100, between=0.01, slept=0.3),
        "ask",
        workers=2,
    ),
    Row(
        "kept in workers, the first window asking for more only asks",
        window(workers=1, waited=0.8, slept=None, idle=1.5),
        "ask",
        workers=2,
    ),
    Row("too few batches to judge", window(batches=5, slept=0.5), "wait"),
    Row("too short to judge", window(seconds=0.1, slept=0.5), "wait"),
    Row("a training thread that computes beside the threads", window(slept=0.02), "stay"),
    Row(
        "the training thread sleeps beside fetching that computes: workers for 1.5x its CPU",
        window(slept=0.3, loader_cores=0.8),
        "move",
        workers=2,
    ),
    Row(
        "as many workers as cores at most",
        window(slept=0.3, loader_cores=1.2, cores=2),
        "move",
        workers=2,
    ),
    Row(
        "two workers at least, that cover each other's pauses",
        window(slept=0.3, loader_cores=0.15),
        "move",
        workers=2,
    ),
    Row(
        "one worker on one core",
        window(slept=0.3, loader_cores=0.15, cores=1),
        "move",
        workers=1,
    ),
    Row(
        "the training thread sleeps, fetching idles: its own waits (a GPU), not the GIL",
        window(slept=0.4, loader_cores=0.02),
        "stay",
    ),
    Row(
        "long steps, a small share slept but more a batch than a worker's batch costs: move",
        window(batches=12, between=1 / 12, slept=0.04, loader_cores=0.3),
        "move",
        workers=2,
        asked=ASKED,
    ),
    Row(
        "fetching keeps a twentieth of a core busy: enough to put the sleep down to it",
        window(slept=0.3, loader_cores=0.07),
        "move",
        workers=2,
    ),
    Row(
        "short steps, the share over its bound but under 1.5 ms a batch: not worth a move",
        window(batches=40, slept=0.05),
        "stay",
    ),
    Row(
        "very long steps: many ms a batch, but a share under its bound",
        window(batches=8, seconds=8.0, between=1.0, slept=0.02),
        "stay",
    ),
    Row(
        "the consumer waits while fetching keeps one core busy and cores idle: GIL-bound",
        window(waited=0.9, slept=None, loader_cores=1.0),
        "move",
        workers=4,
        asked=ASKED,
    ),
    Row(
        "the consumer waits while fetching keeps several cores busy: threads scale",
        window(waited=0.9, slept=None, loader_cores=3.0),
        "stay",
    ),
    Row(
        "the consumer waits, but the machine has no idle core to give",
        window(waited=0.9, slept=None, loader_cores=1.0, idle=0.2),
        "stay",
    ),
    Row(
        "the consumer waits on one core: no other core to move to",
        window(waited=0.9, slept=None, loader_cores=0.9, cores=1),
        "stay",
    ),
    Row(
        "a trial is not allowed (one failed lately, or the dataset cannot move)",
        window(slept=0.3),
        "stay",
        may_try=False,
    ),
    Row(
        "a trial in workers that paid is kept",
        window(workers=2, batches=int(40 * KEEP_GAIN) + 1, slept=None),
        "keep",
        workers=2,
        trial_rate=40.0,
    ),
    Row(
        "a trial's first window that falls short: measured once more",
        window(workers=2, batches=40, slept=None),
        "ask",
        workers=2,
        trial_rate=40.0,
    ),
    Row(
        "a trial short on its two windows together goes back",
        window(workers=2, batches=44, slept=None),
        "back",
        trial_rate=40.0,
        asked=window(workers=2, batches=36, slept=None),
    ),
    Row(
        "a trial that pays on its two windows together is kept",
        window(workers=2, batches=46, slept=None),
        "keep",
        workers=2,
        trial_rate=40.0,
        asked=window(workers=2, batches=40, slept=None),
    ),
    Row(
        "a first window three times the ms a batch, but not three times the share, only asks",
        window(batches=10, between=0.1, slept=0.08),
        "ask",
        workers=2,
    ),
    Row(
        "kept in workers, the consumer fed: stays",
        window(workers=2, waited=0.1, slept=None),
        "stay",
    ),
    Row(
        "kept in workers, the consumer waits with idle cores: twice the workers, tried",
        window(workers=1, waited=0.8, slept=None, idle=1.5),
        "move",
        workers=2,
        asked=ASKED,
    ),
    Row(
        "kept in workers, the consumer waits, no idle core: stays",
        window(workers=2, waited=0.8, slept=None, idle=0.1),
        "stay",
    ),
    Row(
        "kept in workers, the machine's idle cores unknown: stays",
        window(workers=2, waited=0.8, slept=None, idle=None),
        "stay",
    ),
    Row(
        "kept in as many workers as cores: stays",
        window(workers=4, waited=0.8, slept=None, idle=1.5),
        "stay",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_decision_table(row: Row) -> None:
    decision = decide(row.sample, row.trial_rate, row.may_try, row.asked)
    assert decision.action == row.action, decision.why
    if row.action in ("move", "keep", "ask"):
        assert decision.workers == row.workers, decision.why
    if row.action == "move":  # judged against the windows that asked, together
        asked, sample = row.asked, row.sample
        if asked is None:
            assert decision.baseline == sample.rate
        else:
            together = (asked.batches + sample.batches) / (asked.seconds + sample.seconds)
            assert decision.baseline == pytest.approx(together)
    if row.action != "wait":
        assert decision.why  # every decision says why


def test_a_trial_is_judged_against_the_rate_of_the_windows_that_asked_together() -> None:
    # 30 batches in one second, then 60 in one second: 45 a second, whichever came first.
    fast = window(slept=0.08, batches=60)
    assert decide(fast, None, True, asked=ASKED).baseline == pytest.approx(45.0)
    # Weighted by time: 30 in one second, then 60 in two: 30 a second.
    slow = window(slept=0.08, batches=60, seconds=2.0)
    assert decide(slow, None, True, asked=ASKED).baseline == pytest.approx(30.0)


def test_a_trial_window_leaves_out_more_batches_and_is_longer() -> None:
    trial = Window(2, trial=True)
    now = 0.0
    for _ in range(TRIAL_SKIP):
        assert not trial.ready()
        trial.took(now, False, None, None)
    for _ in range(TRIAL_BATCHES - 1):
        now += TRIAL_SECONDS  # long enough: only the batches are short
        trial.took(now, False, None, None)
        assert not trial.ready()
    now += 0.001
    trial.took(now, False, None, None)
    assert trial.ready()
    assert trial.sample(cores=4).batches == TRIAL_BATCHES
    # Enough batches, too short a time: not yet.
    quick = Window(2, trial=True)
    now = 0.0
    for _ in range(TRIAL_SKIP + TRIAL_BATCHES):
        now += 0.001
        quick.took(now, False, None, None)
    assert not quick.ready()
    quick.took(now + TRIAL_SECONDS, False, None, None)
    assert quick.ready()
    # The window after a trial's is an ordinary one.
    trial.restart()
    trial.took(now, False, None, None)
    for _ in range(MIN_BATCHES):
        now += 1.0
        trial.took(now, False, None, None)
    assert trial.ready()
    assert trial.sample(cores=4).batches == MIN_BATCHES


def test_the_sleep_a_batch_is_over_the_batches_it_was_measured_on() -> None:
    # The batch after a wait has no time between batches (the wait is not the consumer's
    # step): it must not dilute, nor inflate, the sleep a batch. Here the thread sleeps 1 ms
    # of each 25 ms step it was measured on, and every other batch came after a 50 ms wait.
    window = Window(0)
    now = 0.0
    for _ in range(SKIP_BATCHES):
        window.took(now, False, None, None)
    for k in range(16):
        waited = k % 2 == 1
        now += 0.075 if waited else 0.025
        between, computing = (None, None) if waited else (0.025, 1 - 0.001 / 0.025)
        window.took(now, waited, between, computing)
    sample = window.sample(cores=4)
    assert sample.between == pytest.approx(0.025)
    assert sample.slept == pytest.approx(0.04)
    assert sample.slept_seconds == pytest.approx(0.001)  # not 0.04 * 0.05 s a batch
    assert decide(replace(sample, loader_cores=0.5), None, True).action == "stay"


def test_each_trial_that_goes_back_doubles_the_wait_for_the_next_up_to_the_most() -> None:
    # One trial that noise sent back costs a long run only RETRY_AFTER seconds of the gain;
    # a loader whose trials keep going back tries ever more rarely.
    placement = Placement(auto=True, trial_rate=10.0)
    waits = []
    now = 1000.0
    for _ in range(8):
        placement.went_back(now)
        assert placement.trial_rate is None
        waits.append(placement.retry_at - now)
        now = placement.retry_at
    assert waits[:3] == [RETRY_AFTER, 2 * RETRY_AFTER, 4 * RETRY_AFTER]
    assert waits == sorted(waits)
    assert waits[-1] == RETRY_MOST
    assert placement.backs == 8
