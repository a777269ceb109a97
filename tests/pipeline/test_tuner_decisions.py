"""The tuner's decisions: a table of windows given by hand and what :func:`decide` decides.

Each row starts tuned stages somewhere, gives :func:`decide` a few windows (items out a
second, the cores the process kept busy, each stage's call time and busy share, see
:class:`W`), and lists the decisions each window must bring, as ``"stage action to"``
(``raise``/``lower``: a trial; ``keep``: a trial kept; ``undo``: back where it was;
``trim``: lowered for good). Then simulations run the same rules against models of ops
whose best concurrency is known. ``test_tuner.py`` runs real pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from feedline._retry import RETRY_AFTER
from feedline.pipeline._decide import Memory
from feedline.pipeline._settings import CEILING_TTL

from ._windows import Play, W, computes, gate, holds_the_gil, server, waits

# After a raise of 4 to 8 calls of 4 ms (1,000 items/s): a window as fast, calls as long.
SAME = W(1000, task=0.004)


@dataclass(frozen=True)
class Case:
    """One row: stages, windows, the decisions of each window, what the tuner knows after."""

    name: str
    windows: list[W]
    expect: list[str]
    start: tuple[int, ...] = (4,)
    names: tuple[str, ...] = ("s",)
    high: int | tuple[int, ...] = 8
    memory: Memory | None = None
    after: dict[str, Any] = field(default_factory=dict)  # the first stage's Memory fields
    movable: bool = False  # the first stage may move to processes (executor="auto")
    moves: bool = True  # ... and its workers take the op
    cpu_budget: float = 2.0


def _slowed(*then: W) -> list[W]:
    # Reads of 10 ms at 16 (32 did not pay, back to 16); the store slows to 100 ms; the
    # window after the put-back judges no conditions, and the read goes halfway to its old
    # ceiling, 24.
    return [
        W(1000, 0.3, 0.01),
        W(1010, 0.3, 0.01),
        W(160, 0.05, 0.1),
        *then,
    ]


CASES = [
    # -- raising the bottleneck ------------------------------------------------------------------
    Case("the busiest stage doubles", [W(1000)], ["s raise 8"]),
    Case("within its bound", [W(1000)], ["s raise 8"], start=(5,)),
    Case("not past its bound", [W(1000)], [""], start=(8,)),
    Case("not when its slots idle", [W(1000, busy=0.5)], [""]),
    Case("not when its output is full", [W(1000, blocked=0.8)], [""]),
    Case("not on busy cores", [W(1000, cores=1.92)], [""]),
    Case("not past what the memory budget holds", [W(1000, room=1)], ["s raise 5"]),
    Case("not at all when the budget is full", [W(1000, room=0)], [""]),
    Case(
        "the busier of two stages",
        [W(500, busy=(0.7, 0.9))],
        ["b raise 8"],
        start=(4, 4),
        names=("a", "b"),
    ),
    Case(
        "below a ceiling, halfway to it",
        [W(400, task=0.01)],
        ["s raise 18"],
        memory=Memory(ceiling=32, ceiling_until=CEILING_TTL, task=0.01),
        high=64,
    ),
    Case(
        "below a ceiling, not for less than a quarter more",
        [W(400)],
        [""],
        start=(8,),
        memory=Memory(ceiling=10, ceiling_until=CEILING_TTL),
        high=64,
    ),
    Case(
        # 2 reads of 30 ms feed 2 checks of 2 ms that wait for items: 38 reads would feed
        # them (Little's law), 8 times at most at once.
        "to feed a next stage that waits",
        [
            W(66, 0.1, (0.03, 0.002), (1.0, 0.07), seconds=0.1, first=True),
            W(533, 0.1, (0.03, 0.002), (1.0, 0.53)),
        ],
        ["read raise 16", "read keep 16; read raise 38"],
        start=(2, 2),
        names=("read", "check"),
        high=(64, 4),
    ),
    Case(
        "to feed a next stage of microseconds: 8 times at most",
        [W(200, 0.1, (0.02, 1e-6), (1.0, 0.0001), seconds=0.1, first=True)],
        ["read raise 32"],
        names=("read", "check"),
        start=(4, 2),
        high=256,
    ),
    # -- judging a raise -------------------------------------------------------------------------
    Case("a raise that pays is kept", [W(1000), W(2000)], ["s raise 8", "s keep 8"], high=8),
    Case(
        "a raise that pays is kept and the next is tried",
        [W(1000), W(2000)],
        ["s raise 8", "s keep 8; s raise 16"],
        high=32,
    ),
    Case(
        "a raise that brings less than a quarter of a doubling is not kept",
        [W(1000, 1.5, 0.01), W(1060, 1.5, 0.01)],
        ["s raise 4", "s undo 2"],
        start=(2,),
        after={"ceiling": 4},
    ),
    Case(
        "a raise of calls that wait is kept for 5 %",
        [W(1000, 0.3, 0.01), W(1060, 0.3, 0.01)],
        ["s raise 4", "s keep 4; s raise 8"],
        start=(2,),
    ),
    Case(
        "a raise whose calls got as much longer is not kept, however the output went",
        [W(1000), W(1500, task=0.008)],
        ["s raise 8", "s lower 2"],
    ),
    Case(
        # 2 -> 16 to feed the next stage must bring what 2 -> 8 must: 1.75 times, not 2.75.
        "a raise of over 4 times is judged as one of 4",
        [
            W(66, 0.1, (0.03, 0.002), (1.0, 0.07), seconds=0.1, first=True),
            W(120, 0.1, (0.03, 0.002), (1.0, 0.12)),
        ],
        ["read raise 16", "read keep 16; read raise 38"],
        start=(2, 2),
        names=("read", "check"),
        high=(64, 4),
    ),
    Case(
        "a raise the output's end cuts short is kept",
        [W(1000), W(0, ended=True)],
        ["s raise 8", "s keep 8"],
    ),
    Case(
        # 2 reads of 10 ms and 1 decode of 5 ms both end 200 items/s: the read's raise
        # brings nothing alone, and is kept; the decode goes next.
        "a raise is kept while another stage then limits",
        [
            W(200, 0.1, (0.01, 0.005), (1.0, 1.0)),
            W(200, 0.1, (0.01, 0.005), (0.5, 1.0)),
        ],
        ["read raise 4", "read keep 4; decode raise 2"],
        start=(2, 1),
        names=("read", "decode"),
    ),
    # -- after a raise that did not pay ----------------------------------------------------------
    Case(
        "calls as long: fewer could not end as many, back where it was",
        [W(1000), SAME],
        ["s raise 8", "s undo 4"],
        after={"ceiling": 8, "settle": 3},
    ),
    Case(
        "calls that got longer: fewer are tried",
        [W(1000), W(1000, 1.0, 0.008)],
        ["s raise 8", "s lower 2"],
        after={"ceiling": 8},
    ),
    Case(
        "fewer, but not below the cores kept busy",
        [W(1000, task=0.002), W(1000, 1.8, 0.004)],
        ["s raise 4", "s undo 2"],
        start=(2,),
    ),
    Case(
        "fewer where one core was busy (an op that holds the GIL)",
        [W(1000, task=0.002), W(1000, 1.0, 0.004)],
        ["s raise 4", "s lower 1"],
        start=(2,),
    ),
    Case(
        "fewer, but not at or below a floor",
        [W(1000), W(1000, 1.0, 0.008)],
        ["s raise 8", "s undo 4"],
        memory=Memory(floor=2, floor_until=CEILING_TTL),
    ),
    Case(
        "fewer, below a floor that lapsed (found in one noisy window, it is tried again)",
        [W(1000, sink_full=0.9), W(1000, sink_full=0.9)],
        ["", "s lower 2"],
        memory=Memory(floor=2, floor_until=0.5),
    ),
    Case(
        "fewer as fast are kept",
        [W(1000), W(1000, 1.0, 0.008), W(1000, 1.92, 0.002)],
        ["s raise 8", "s lower 2", "s keep 2"],
        after={"ceiling": 8},
    ),
    Case(
        "fewer judged on a window that ended no call go by the rate",
        [W(1000), W(1000, 1.0, 0.008), W(1000, 1.92, 0.0)],
        ["s raise 8", "s lower 2", "s keep 2"],
    ),
    Case(
        # The items queued behind the stage keep its output up for a window after a cut; 2
        # calls of 4 ms end 500 a second where 1,000 were wanted.
        "fewer that look as fast but cannot end as many are put back, and become a floor",
        [W(1000), W(1000, 1.0, 0.008), W(1000, 1.0, 0.004)],
        ["s raise 8", "s lower 2", "s undo 4"],
        after={"floor": 2, "ceiling": 8},
    ),
    Case(
        "fewer that are slower are put back",
        [W(1000), W(1000, 1.0, 0.008), W(600, 1.0, 0.002)],
        ["s raise 8", "s lower 2", "s undo 4"],
    ),
    # -- the run's first window ------------------------------------------------------------------
    Case(
        "the first window raises on idle cores, and a raise that pays stands",
        [W(100, 0.3, 0.02, first=True, seconds=0.1), W(200, 0.4, 0.02)],
        ["s raise 4", "s keep 4; s raise 8"],
        start=(2,),
    ),
    Case(
        "the first window raises on idle cores; busy cores later keep it",
        [W(100, 0.3, 0.02, first=True, seconds=0.1), W(200, 1.92, 0.02)],
        ["s raise 4", "s keep 4"],
        start=(2,),
    ),
    Case(
        # The start-up held the first window's rate down: a raise judged against it would
        # look as if it paid.
        "the first window raises nothing on busy cores",
        [W(400, 1.7, 0.005, first=True, seconds=0.1), W(1000, 1.92, 0.004)],
        ["", ""],
        start=(2,),
    ),
    Case(
        "the first window's calls are no measure: fewer are tried though calls were as long",
        [W(400, 1.0, 0.004, first=True, seconds=0.1), W(400, 1.0, 0.004)],
        ["s raise 4", "s lower 1"],
        start=(2,),
    ),
    Case(
        # Calls that compute (or hold the GIL): the raise looked as if it paid against the
        # start-up, and is tried back; as fast there, it stays, and the next raise is judged
        # on warm windows.
        "a raise kept against the first window is tried back, and fewer kept if as fast",
        [
            W(400, 1.0, 0.0025, first=True, seconds=0.1),
            W(800, 1.0, 0.0025),
            W(800, 1.0, 0.00125),
        ],
        ["s raise 2", "s keep 2; s lower 1", "s keep 1; s raise 2"],
        start=(1,),
    ),
    Case(
        # 2 reads of 30 ms feed 2 decodes that keep 1.5 cores busy: the raise was sized
        # from call times (Little's law), the cores are the decodes'.
        "a raise to feed the next stage, kept against the first window, is not tried back",
        [
            W(66, 1.5, (0.03, 0.002), (1.0, 0.07), seconds=0.1, first=True),
            W(533, 1.5, (0.03, 0.002), (1.0, 0.53)),
        ],
        ["read raise 16", "read keep 16; read raise 38"],
        start=(2, 2),
        names=("read", "check"),
        high=(64, 4),
    ),
    Case(
        # Python code on free-threaded Python: the second thread doubles the rate.
        "a raise kept against the first window, tried back and slower there, is put back",
        [
            W(400, 1.0, 0.0025, first=True, seconds=0.1),
            W(800, 1.9, 0.0025),
            W(400, 1.0, 0.0025),
        ],
        ["s raise 2", "s keep 2; s lower 1", "s undo 2"],
        start=(1,),
        after={"floor": 1},
    ),
    Case(
        # Its rate held down by the start-up, but calls twice as long at twice as many: the
        # stage's capacity did not grow (a decode on busy cores).
        "a raise from the first window whose calls got as much longer is not kept",
        [W(400, 1.0, 0.005, first=True, seconds=0.1), W(600, 1.5, 0.01)],
        ["s raise 4", "s undo 2"],
        start=(2,),
    ),
    Case(
        "the first window raises even if nothing came out yet (slow first calls)",
        [W(0, 0.1, 0.0, first=True, seconds=0.1), W(80, 0.1, 0.1)],
        ["s raise 8", "s keep 8; s raise 16"],
        high=64,
    ),
    Case(
        "the first window does not lower for a slower consumer",
        [W(100, 0.1, 0.02, sink_full=0.9, first=True, seconds=0.1)],
        [""],
        start=(16,),
        high=64,
    ),
    # -- a slower consumer -----------------------------------------------------------------------
    Case(
        "the consumer slower: nothing raised, the busiest stage tried at half",
        [W(1000, 1.0, 0.004, sink_full=0.9)],
        ["s lower 2"],
    ),
    Case(
        "for a consumer slower, half is put back if it cannot end the calls wanted",
        [W(1000, 1.0, 0.004, sink_full=0.9), W(1000, 1.0, 0.004, sink_full=0.9)],
        ["s lower 2", "s undo 4"],
        after={"floor": 2},
    ),
    Case(
        "for a consumer slower, half is kept where it can",
        [W(400, 1.0, 0.01, sink_full=0.9), W(400, 1.0, 0.004, sink_full=0.9)],
        ["s lower 2", "s keep 2; s lower 1"],
    ),
    Case(
        "a consumer that paused changes nothing",
        [W(800, 0.05, 0.02, 0.5), W(0, 0.0, 0.0, 0.0, sink_full=1.0, seconds=2.0)],
        ["", ""],
        start=(16,),
        high=256,
    ),
    # -- trimming --------------------------------------------------------------------------------
    Case(
        "a stage that used few slots three windows in a row is trimmed to them plus room",
        [W(100, busy=0.1)] * 3,
        ["", "", "s trim 4"],
        start=(16,),
        high=64,
        after={"ceiling": 16},
    ),
    Case(
        "a stage that used its slots again starts counting anew",
        [W(100, busy=b) for b in (0.1, 0.1, 0.7, 0.1, 0.1, 0.1)],
        ["", "", "", "", "", "s trim 4"],
        start=(16,),
        high=16,
    ),
    Case(
        "trimmed below a ceiling, that ceiling stays",
        [W(100, busy=0.1)] * 3,
        ["", "", "s trim 4"],
        start=(16,),
        high=64,
        memory=Memory(ceiling=12, ceiling_until=CEILING_TTL),
        after={"ceiling": 12},
    ),
    # -- conditions that change ------------------------------------------------------------------
    Case(
        "a ceiling lapses after CEILING_TTL",
        [W(400, seconds=CEILING_TTL)],
        ["s raise 8"],
        memory=Memory(ceiling=6, ceiling_until=CEILING_TTL),
    ),
    Case(
        # It ends the trial's calls, longer than calls at the value put back; calls longer
        # in the window after that are a change: 3 times as long, 3 times the calls.
        "the window after a put-back does not clear the ceiling, the next one does",
        [W(1000), SAME, W(1000, task=0.012, busy=0.5), W(1000, task=0.012, busy=0.5)],
        ["s raise 8", "s undo 4", "", ""],
        after={"ceiling": None, "jump": 12},
    ),
    Case(
        # Kept at 24 where 32 had not paid at 10 ms: the calls were 10 times as long before
        # the raise as after it, so the ceiling goes, and the next raise goes to 10 times
        # the 16 calls the stage had (the rate it had).
        "a raise kept on calls ten times longer drops the ceiling and jumps ten times",
        _slowed(W(240, 0.05, 0.1)),
        ["s raise 32", "s undo 16", "s raise 24", "s keep 24; s raise 160"],
        start=(16,),
        high=4096,
        after={"ceiling": None},
    ),
    Case(
        "a raise after a window that ended no call still drops a stale ceiling",
        [W(1000, 0.3, 0.01), W(1010, 0.3, 0.01), W(160, 0.05, 0.0), W(240, 0.05, 0.1)],
        ["s raise 32", "s undo 16", "s raise 24", "s keep 24; s raise 48"],
        start=(16,),
        high=4096,
        after={"ceiling": None},
    ),
    Case(
        # After the jump the server is at its limit: calls about as much longer as there are
        # more of them, the output a tenth more. No change of conditions: it doubles.
        "calls a raise itself made longer do not make the next raise jump",
        _slowed(W(240, 0.05, 0.1), W(265, 0.05, 0.6)),
        [
            "s raise 32",
            "s undo 16",
            "s raise 24",
            "s keep 24; s raise 160",
            "s keep 160; s raise 320",
        ],
        start=(16,),
        high=4096,
    ),
    Case(
        "a ceiling stays where only the raise made the calls longer",
        [W(400, 0.05, 0.01), W(440, 0.05, 0.03)],
        ["s raise 18", "s keep 18; s raise 25"],
        high=4096,
        memory=Memory(ceiling=32, ceiling_until=CEILING_TTL, task=0.01, settle=1),
        after={"ceiling": 32},
    ),
    # -- moving a stage of executor="auto" to processes --------------------------------------------
    # 2 calls of 3 ms that hold the GIL: 4 are no faster, the calls keep 1 core busy, 1 idle.
    Case(
        "a stage that holds the GIL moves to processes, kept where the output grows",
        [W(330, 1.0, 0.006, cpu=1.0), W(340, 1.0, 0.012, cpu=1.0), W(600, 0.3, 0.006)],
        ["s raise 4", "s move 4", "s keep 4"],
        start=(2,),
        movable=True,
    ),
    Case(
        # Its slots 55 % busy (the source and the consumer wait on the GIL too): nothing to
        # raise, the process keeping one core busy, the stage's calls most of it.
        "a stage that holds the GIL with nothing to raise moves to processes",
        [W(330, 1.0, 0.006, busy=0.55, cpu=0.6), W(600, 1.3, 0.006)],
        ["s move 4", "s keep 4"],
        start=(2,),
        movable=True,
    ),
    Case(
        # A decode starved by slow reads upstream: its 2 calls run 40 % of the time and
        # compute throughout (0.8 cores for 0.8 calls in flight), the process at one core.
        "not with nothing to raise where the calls compute all the time they run",
        [W(200, 1.0, 0.004, busy=0.4, cpu=0.8)],
        [""],
        start=(2,),
        movable=True,
    ),
    Case(
        # This process keeps one core busy, but another process (a server) the other one.
        "not where another process keeps the cores this one leaves idle busy",
        [W(330, 1.0, 0.006, cpu=1.0, idle=1.0), W(340, 1.0, 0.012, cpu=1.0, idle=0.05)],
        ["s raise 4", "s lower 1"],
        start=(2,),
        movable=True,
    ),
    Case(
        # The stage's calls keep 0.8 cores busy, the whole process 1.3: more than threads of
        # Python code can under the GIL, so the GIL is not what limits it.
        "not with nothing to raise where the process keeps more than the GIL allows busy",
        [W(330, 1.3, 0.006, busy=0.55, cpu=0.8)],
        [""],
        start=(2,),
        movable=True,
    ),
    Case(
        "not with nothing to raise where the stage's output is full (the next stage limits)",
        [W(330, 1.0, 0.006, busy=0.55, cpu=0.6, blocked=0.8)],
        [""],
        start=(2,),
        movable=True,
    ),
    Case(
        "not to a single process (its bound allows three calls)",
        [W(330, 1.0, 0.006, cpu=1.0), W(340, 1.0, 0.008, cpu=1.0)],
        ["s raise 3", "s lower 1"],
        start=(2,),
        high=3,
        movable=True,
    ),
    Case(
        "not with nothing to raise where the process keeps more than a core busy",
        [W(330, 1.4, 0.006, busy=0.55, cpu=0.6)],
        [""],
        start=(2,),
        movable=True,
    ),
    Case(
        "in processes it is not raised, trimmed nor lowered",
        [W(330, 1.0, 0.006, cpu=1.0), W(340, 1.0, 0.012, cpu=1.0), *[W(600, 0.3, 0.006)] * 4],
        ["s raise 4", "s move 4", "s keep 4", "", "", ""],
        start=(2,),
        movable=True,
    ),
    Case(
        "moved back where the output does not grow, and not tried again for RETRY_AFTER",
        [
            W(330, 1.0, 0.006, cpu=1.0),
            W(340, 1.0, 0.012, cpu=1.0),
            W(350, 1.0, 0.006),
            W(330, 1.0, 0.006, cpu=1.0),
            W(340, 1.0, 0.012, cpu=1.0),
        ],
        ["s raise 4", "s move 4", "s back 2", "s raise 3", "s lower 1"],
        start=(2,),
        movable=True,
        after={"no_move_until": 0.9 + RETRY_AFTER, "backs": 1},
    ),
    Case(
        "moved back a second time: not tried again for twice as long",
        [W(330, 1.0, 0.006, cpu=1.0), W(340, 1.0, 0.012, cpu=1.0), W(350, 1.0, 0.006)],
        ["s raise 4", "s move 4", "s back 2"],
        start=(2,),
        movable=True,
        memory=Memory(backs=1),
        after={"no_move_until": 0.9 + 2 * RETRY_AFTER, "backs": 2},
    ),
    Case(
        "moved back where its workers did not take the op",
        [W(330, 1.0, 0.006, cpu=1.0), W(340, 1.0, 0.012, cpu=1.0), W(330, 1.0, 0.006, cpu=1.0)],
        ["s raise 4", "s move 4", "s back 2"],
        start=(2,),
        movable=True,
        moves=False,
    ),
    Case(
        # A decode that releases the GIL at one call per core: cores busy, none idle.
        "not an op whose raise found the cores busy",
        [W(500, 1.4, 0.004, cpu=1.4), W(510, 1.6, 0.008, cpu=1.6)],
        ["s raise 4", "s undo 2"],
        start=(2,),
        movable=True,
    ),
    Case(
        # A decode on 16 cores at 16 calls, tried at 32: a core and a half idle, the calls
        # keeping 14.5 busy, more than the GIL lets threads of Python code.
        "not an op whose calls kept more cores busy than the GIL allows",
        [W(4000, 14.5, 0.004, cpu=14.5), W(4050, 14.5, 0.008, cpu=14.5)],
        ["s raise 32", "s lower 14"],
        start=(16,),
        high=64,
        movable=True,
        cpu_budget=16.0,
    ),
    Case(
        # Calls that wait on a server at its limit: little CPU, processes would not help.
        "not calls that wait",
        [W(330, 0.2, 0.006, cpu=0.1), W(340, 0.2, 0.012, cpu=0.1)],
        ["s raise 4", "s lower 1"],
        start=(2,),
        movable=True,
    ),
    Case(
        "not a stage that cannot move",
        [W(330, 1.0, 0.006, cpu=1.0), W(340, 1.0, 0.012, cpu=1.0)],
        ["s raise 4", "s lower 1"],
        start=(2,),
    ),
    Case(
        # Kept at 24 with the consumer the slower side (half is tried there, and put back),
        # five windows pass; the next raise doubles.
        "a jump not taken within JUMP_WINDOWS lapses",
        _slowed(
            W(240, 0.05, 0.1, sink_full=0.9),
            *[W(240, 0.05, 0.1, sink_full=0.9, busy=0.5)] * 4,
            W(240, 0.05, 0.1),
        ),
        [
            "s raise 32",
            "s undo 16",
            "s raise 24",
            "s keep 24; s lower 12",
            "s undo 24",
            *["", "", ""],
            "s raise 48",
        ],
        start=(16,),
        high=4096,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decisions(case: Case) -> None:
    play = Play(case.start, case.names, case.high, case.memory, case.movable, case.moves)
    play.cpu_budget = case.cpu_budget
    got = [play.window(w) for w in case.windows]
    assert got == case.expect, play.decisions
    memory = play.memory()
    for name, value in case.after.items():
        assert getattr(memory, name) == value, (name, memory, play.decisions)


def test_every_rule_has_a_row() -> None:
    # Each action, and each reason a raise gives, shows in the table.
    play_all = [Play(c.start, c.names, c.high, c.memory, c.movable, c.moves) for c in CASES]
    texts = []
    for play, case in zip(play_all, CASES, strict=True):
        for w in case.windows:
            play.window(w)
        texts.append(play.decisions)
    text = "\n".join(texts)
    for reason in (
        "the busiest",
        "to feed the next",
        "calls longer",
        "halfway to",
        "kept (",
        "kept, as fast",
        "limits now",
        "did not pay",
        "was slower",
        "the consumer is slower",
        "it used",
        "against the start-up",
        "trying 2 processes",
        "nothing to raise;",
        "processes (2) kept",
        "processes did not pay",
        "it could not move",
    ):
        assert reason in text, reason


# -- simulations: the rules against models of ops -------------------------------------------------


def test_an_async_read_converges_to_what_the_server_serves_at_once() -> None:
    # 16 reads of 20 ms at once: 4 -> 8 -> 16 pay; 32 does not and is undone, 16 stays.
    play = Play((4,), high=256)
    seen = play.run(server(16, 0.02), windows=30)
    assert "4 -> 8 kept" in play.decisions
    assert "32 did not pay" in play.decisions
    assert seen[-10:] == [16] * 10, (seen, play.decisions)


def test_a_threaded_stage_that_waits_converges_within_a_band_of_the_best() -> None:
    # A gate of 6 calls of 10 ms: it settles at 6 to 12 (a doubling short of what pays
    # does not pay enough to keep).
    play = Play((2,), high=32)
    seen = play.run(server(6, 0.01), windows=30)
    assert all(6 <= c <= 12 for c in seen[-10:]), (seen, play.decisions)


@pytest.mark.parametrize(
    ("model", "best"),
    [(holds_the_gil(0.0005), 1), (computes(0.0005), 2)],
    ids=["with the GIL", "free-threaded"],
)
def test_python_code_gets_the_threads_that_make_it_faster(model: Any, best: int) -> None:
    # The same op of Python code: one call at a time under the GIL (more only make each
    # call longer), one per core on free-threaded Python (1.96 times as fast on two). The
    # rules judge what more calls did, never which interpreter runs.
    for start in (1, 2):
        play = Play((start,), high=32)
        seen = play.run(model, windows=20)
        assert max(seen) <= 4, (seen, play.decisions)
        assert seen[-5:] == [best] * 5, (start, seen, play.decisions)


def test_cpu_work_is_not_raised_past_the_cores() -> None:
    # A second call pays (a second core); once the cores are busy no raise is tried.
    play = Play((1,), high=32)
    seen = play.run(computes(0.005), windows=20)
    assert "1 -> 2 kept" in play.decisions
    assert max(seen) == 2, (seen, play.decisions)


def test_two_stages_at_the_same_rate_are_raised_in_turn() -> None:
    # A read of 10 ms feeds a step of 2 ms: neither raise pays alone once both run at one
    # rate; both go past where they would stall (read 8, step 2).
    play = Play((2, 2), ("read", "decode"), high=32)
    play.run_row([waits(0.01), waits(0.002)], windows=20)
    assert "decode: 2 -> 4 kept" in play.decisions
    assert (play.of("read"), play.of("decode")) >= (16, 4), play.decisions


def test_a_stage_feeding_one_held_below_its_ceiling_settles() -> None:
    # "check" serves 2 calls at once, so its raise does not pay and it gets a ceiling; a
    # raise of "read" that only makes "check" the limit is not kept for it to follow (it
    # went up, was trimmed back, and went up again, every second or so).
    play = Play((4, 2), ("read", "check"), high=256)
    seen = play.run_row([waits(0.02), gate(2, 0.001)], windows=60)
    assert "check: 3 did not pay" in play.decisions
    assert "read: 64 -> 128 kept" not in play.decisions
    assert "slots" not in play.decisions  # never trimmed
    assert len(set(seen[-30:])) == 1, (seen, play.decisions)  # settled


def test_a_cheap_next_stage_does_not_send_a_read_past_what_the_server_serves() -> None:
    # len() takes microseconds: a raise to feed it goes 8 times at most, and is undone when
    # it does not pay: the read settles where the server serves, 8 at once.
    play = Play((4, 2), ("read", "check"), high=256)
    seen = play.run_row([gate(8, 0.02), waits(1e-6)], windows=40)
    reads = [r for r, _ in seen]
    assert reads[:2] == [4, 32], reads
    assert all(8 <= r < 32 for r in reads[-10:]), (reads, play.decisions)
