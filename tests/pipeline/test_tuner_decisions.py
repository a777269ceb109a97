"""The tuner's decisions from the figures it measures, given by hand (``_windows``).

A real run measures them on the machine it runs on: a loaded one measures other figures and
rightly decides otherwise (more threads of a CPU-bound op pay there, taking a larger share
of the cores from the other programs), and measures them later. Here each test gives the
windows, from a model of an op where the best concurrency is known (a server that serves
``k`` at once, an op that holds the GIL, one that computes), and asserts the decisions.
``test_tuner.py`` runs real pipelines, asserting what holds on any machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from feedline.pipeline._growth import Growth
from feedline.pipeline._queue import Channel
from feedline.pipeline._tuner import Knob, Tuner
from feedline.pipeline._tuning import Tuning

from ._windows import Stage, Windows, computes, holds_the_gil, server


def _two(
    w: Windows, stages: list[Callable[[int], tuple[float, float]]], windows: int
) -> list[tuple[int, ...]]:
    """``windows`` windows of two stages in a row, each ``stages[i](c) -> (calls it can end a
    second, seconds a call)`` at its concurrency ``c`` then: the output goes at the slower's
    pace, the other's slots busy only that share of the time (starved or held up), the cores
    idle (the calls wait). Returns the stages' concurrency in each window."""
    seen = []
    for k in range(windows + 1):
        now = [s.counters.concurrency for s in w.stages]
        seen.append(tuple(now))
        capacity, task = zip(*(stage(c) for stage, c in zip(stages, now, strict=True)), strict=True)
        rate = min(capacity)
        w.window(
            0.1 if k == 0 else 0.3,
            rate=rate,
            cores=0.1,
            task=task,
            first=k == 0,
            busy=[min(1.0, rate / c) for c in capacity],
        )
    return seen


def _waits(seconds: float) -> Callable[[int], tuple[float, float]]:
    """For ``_two``: calls that wait ``seconds`` each, however many at once."""
    return lambda c: (c / seconds, seconds)


def test_an_async_read_converges_to_what_the_server_serves_at_once() -> None:
    # A server that serves 16 reads of 20 ms at once: 4 -> 8 -> 16 pay; 32 does not and is
    # undone (then 24 and 20 are tried and undone), and 16 stays.
    w = Windows(4, high=256)
    seen = w.run(server(16, 0.02), windows=30)
    assert "4 -> 8 kept" in w.decisions
    assert "8 -> 16 kept" in w.decisions
    assert "32 did not pay" in w.decisions
    assert seen[-10:] == [16] * 10, (seen, w.decisions)


def test_a_threaded_stage_that_waits_converges_within_a_band_of_the_best() -> None:
    # A gate of 6 calls of 10 ms: it settles at 6 to 12 calls (a doubling short of what pays
    # does not pay enough to keep).
    w = Windows(2, high=32)
    seen = w.run(server(6, 0.01), windows=30)
    assert all(6 <= c <= 12 for c in seen[-10:]), (seen, w.decisions)


def test_a_stage_that_holds_the_gil_is_not_raised_for_nothing() -> None:
    # Raises do not pay (the capacity per call falls as calls are added) and are undone; the
    # stage ends at one call, as fast.
    w = Windows(2, high=32)
    seen = w.run(holds_the_gil(0.0005), windows=20)
    assert "4 did not pay" in w.decisions
    assert max(seen) <= 4, (seen, w.decisions)
    assert seen[-5:] == [1] * 5, (seen, w.decisions)


def test_cpu_work_is_not_raised_past_the_cores() -> None:
    # Calls that compute, the GIL released: a second call pays (a second core), and once the
    # cores are busy no raise is even tried.
    w = Windows(1, high=32)
    seen = w.run(computes(0.005), windows=20)
    assert "1 -> 2 kept" in w.decisions
    assert max(seen) == 2, (seen, w.decisions)


def test_the_tuner_does_not_raise_when_the_consumer_is_the_slower_side() -> None:
    # The sink full most of each window: however busy the read's slots, nothing is raised
    # (a cut is tried, and kept where as fast).
    w = Windows(4, high=256)
    seen = []
    for _ in range(10):
        seen.append(w.concurrency)
        w.window(0.3, rate=200, cores=0.05, task=0.005, sink_full=0.9)
    assert max(seen) == 4, (seen, w.decisions)
    assert " kept (" not in w.decisions  # only a cut, "kept, as fast"


def test_a_consumer_that_pauses_does_not_make_the_tuner_lower_stages() -> None:
    # An evaluation, a checkpoint: nothing comes out, the sink is full, the slots are idle.
    # The consumer is no slower for it: no cut is tried. (Only a window wholly within the
    # pause: one that straddles its start, items out at first, looks like a slower consumer,
    # and a cut tried there is kept "as fast" after the pause.)
    w = Windows(16, high=256)
    w.window(0.3, rate=800, cores=0.05, task=0.02, busy=0.5)  # nothing to raise
    assert w.tuner._trial is None
    w.window(2.0, rate=0, cores=0.0, task=0.0, sink_full=1.0, busy=0.0)
    assert w.concurrency == 16
    assert w.tuner._trial is None
    assert w.decisions == ""


def test_two_stages_at_the_same_rate_are_raised_in_turn() -> None:
    # A read of 10 ms feeds a step of 2 ms: neither raise pays alone once both run at the
    # same rate; each goes as far as what the other can take (a raise is kept while the
    # other then limits, or jumps to feed it), and both go past where they would stall.
    w = Windows((2, 2), names=("read", "decode"), high=32)
    _two(w, [_waits(0.01), _waits(0.002)], windows=20)
    assert "read: 2 -> " in w.decisions
    assert "decode: 2 -> 4 kept" in w.decisions
    assert (w.of("read"), w.of("decode")) >= (16, 4), w.decisions


def test_a_raise_is_kept_while_the_next_stage_then_limits() -> None:
    # Two stages at the same rate (2 reads of 10 ms, 1 decode of 5 ms: 200 items/s each):
    # a raise of either alone does not raise the output. The read's is kept, the decode
    # limiting now, and the decode goes next.
    w = Windows((2, 1), names=("read", "decode"), high=32)
    _two(w, [_waits(0.01), _waits(0.005)], windows=2)
    assert "read: 2 -> 4 kept, decode limits now" in w.decisions
    assert "decode: 1 -> 2 kept" in w.decisions


def test_a_stage_feeding_one_held_below_its_ceiling_settles() -> None:
    # "check" serves 2 calls at once whatever its concurrency, so raising it does not pay
    # and it gets a ceiling. A raise of "read" that only makes "check" the limit cannot be
    # kept for "check" to follow: it went up, was trimmed back for the slots it did not
    # use, and went up again, every second or so.
    gate = server(2, 0.001)
    w = Windows((4, 2), names=("read", "check"), high=256)
    seen = _two(w, [_waits(0.02), lambda c: (gate(c)[0], gate(c)[2])], windows=60)
    assert "check: 3 did not pay" in w.decisions
    assert "read: 64 -> 128 kept" not in w.decisions  # not "kept, check limits now"
    assert "read: 128 did not pay" in w.decisions
    assert "slots" not in w.decisions  # never trimmed
    assert len(set(seen[-30:])) == 1, (seen, w.decisions)  # settled


def test_a_read_feeding_a_waiting_stage_jumps_to_what_that_stage_can_take() -> None:
    # The read waits 30 ms; the check after it takes 2 ms on 2 slots (1,000 items/s), and
    # waits for items: the read needs about 38 calls in flight to feed it (Little's law),
    # and goes up 8 times at once (FEED_MOST), not one doubling.
    w = Windows((2, 2), names=("read", "check"), high=64)
    w.knobs[1].high = 4
    _two(w, [_waits(0.03), _waits(0.002)], windows=1)
    assert "read: 2 -> 16 kept" in w.decisions


def test_a_cheap_next_stage_does_not_send_a_read_past_what_the_server_serves() -> None:
    # len() takes microseconds: feeding it "at its capacity" would ask for thousands of reads
    # in flight. A raise to feed it goes 8 times at most, and is undone when it does not pay:
    # the read settles where the server serves, 8 at once.
    read = server(8, 0.02)
    w = Windows((4, 2), names=("read", "check"), high=256)
    seen = _two(w, [lambda c: (read(c)[0], read(c)[2]), _waits(1e-6)], windows=40)
    reads = [r for r, _ in seen]
    assert reads[:2] == [4, 32], reads  # 8 times, not the 50,000 Little's law asks for
    assert all(8 <= r < 32 for r in reads[-10:]), (reads, w.decisions)


def test_a_raise_judged_against_a_cold_start_on_busy_cores_is_tried_back() -> None:
    # The first window's rate is held down by the start-up on mostly busy cores: a raise
    # from 2 to 4 looks like it pays, and is tried back at once; as fast, 2 stays and 4
    # becomes the stage's ceiling.
    w = Windows()
    w.window(0.1, rate=400, cores=1.7, task=0.005, first=True)
    assert w.concurrency == 4
    w.window(0.3, rate=1000, cores=1.8, task=0.004)
    assert w.concurrency == 2, w.decisions
    assert "trying 2 again" in w.decisions
    w.window(0.3, rate=1020, cores=1.92, task=0.002)  # busy cores: nothing raised after it
    assert "4 -> 2 kept, as fast" in w.decisions
    assert w.concurrency == 2, w.decisions
    assert w.knob.ceiling == 4


def test_a_recheck_that_is_slower_puts_the_raise_back() -> None:
    w = Windows()
    w.window(0.1, rate=400, cores=1.7, task=0.005, first=True)
    w.window(0.3, rate=1000, cores=1.8, task=0.004)
    w.window(0.3, rate=600, cores=1.8, task=0.003)
    assert w.concurrency == 4, w.decisions
    assert w.knob.floor == 2


@pytest.mark.parametrize(
    ("first_cores", "later_cores"),
    [(0.3, 0.4), (0.3, 1.9)],  # a read alone; a read whose decode fills the cores later
)
def test_a_raise_from_a_first_window_on_idle_cores_stands(
    first_cores: float, later_cores: float
) -> None:
    w = Windows()
    w.window(0.1, rate=100, cores=first_cores, task=0.02, first=True)
    w.window(0.3, rate=200, cores=later_cores, task=0.02)
    assert w.concurrency >= 4, w.decisions  # kept (and raised again while cores idle)
    assert "again" not in w.decisions


@pytest.mark.parametrize(("cores", "tried"), [(1.8, 2), (1.0, 1)])
def test_after_a_raise_that_did_not_pay_half_stays_above_the_busy_cores(
    cores: float, tried: int
) -> None:
    # From 2 to 4, as fast: tried at half (1) where the process used one core (an op that
    # holds the GIL may run as fast with fewer threads), not where it kept 1.8 busy.
    w = Windows()
    w.window(0.3, rate=1000, cores=0.5, task=0.002)  # not the first window: no recheck
    assert w.concurrency == 4
    w.window(0.3, rate=1000, cores=cores, task=0.004)
    assert "4 did not pay" in w.decisions
    assert w.concurrency == tried, w.decisions


def test_calls_that_wait_are_not_tried_at_half_after_a_raise_that_did_not_pay() -> None:
    # Calls as long at 8 as at 4 (they wait on a server, not on each other): fewer would
    # not shorten them, and 2 of them could end 500 a second where 1,000 are wanted.
    w = Windows(concurrency=4)
    w.window(0.3, rate=1000, cores=0.5, task=0.004)
    assert w.concurrency == 8
    w.window(0.3, rate=1000, cores=0.5, task=0.004)
    assert "8 did not pay" in w.decisions
    assert w.concurrency == 4, w.decisions
    assert w.tuner._trial is None  # no window spent at 2


def test_fewer_calls_that_look_as_fast_but_cannot_end_as_many_are_put_back() -> None:
    # Calls that grew with the raise are tried at half; the window after the cut still
    # puts out 1,000 items a second (from items queued behind the stage), but 2 calls of
    # 4 ms end 500 a second: put back, 2 becoming the floor.
    w = Windows(concurrency=4)
    w.window(0.3, rate=1000, cores=0.5, task=0.004)
    w.window(0.3, rate=1000, cores=1.0, task=0.008)  # contention: tried at half
    assert w.concurrency == 2, w.decisions
    w.window(0.3, rate=1000, cores=1.0, task=0.004)
    assert "back to 4, 2 was slower" in w.decisions
    assert (w.concurrency, w.knob.floor) == (4, 2)
    # Where 2 calls could end as many (they got shorter), the cut is kept.
    w = Windows(concurrency=4)
    w.window(0.3, rate=1000, cores=0.5, task=0.004)
    w.window(0.3, rate=1000, cores=1.0, task=0.008)
    w.window(0.3, rate=1000, cores=1.92, task=0.002)  # busy cores: nothing raised after it
    assert "4 -> 2 kept, as fast" in w.decisions
    assert w.concurrency == 2


def test_a_raise_from_a_cold_window_is_tried_at_half_even_with_calls_as_long() -> None:
    # The first window's calls were slow with the start-up: no measure of how long calls
    # are. Calls as long after the raise may be contention (warm calls twice as long), so
    # half is tried.
    w = Windows(concurrency=2)
    w.window(0.1, rate=400, cores=1.0, task=0.004, first=True)
    assert w.concurrency == 4
    w.window(0.3, rate=400, cores=1.0, task=0.004)
    assert "4 did not pay" in w.decisions
    assert w.concurrency == 1, w.decisions


def test_a_cut_judged_on_a_window_that_ended_no_call_goes_by_the_rate() -> None:
    w = Windows(concurrency=4)
    w.window(0.3, rate=1000, cores=0.5, task=0.004)
    w.window(0.3, rate=1000, cores=1.0, task=0.008)  # contention: tried at half
    assert w.concurrency == 2
    w.window(0.3, rate=1000, cores=1.92, task=0.0)  # no call ended: capacity unknown
    assert "4 -> 2 kept, as fast" in w.decisions


def test_a_cut_for_a_slower_consumer_is_put_back_if_the_stage_cannot_keep_up() -> None:
    # The sink full: the stage is tried at half. 2 calls of 4 ms end 500 a second, where
    # the stage ended 1,000 (its output still looked as fast, from items queued behind it).
    w = Windows(concurrency=4)
    w.window(0.3, rate=1000, cores=1.0, task=0.004, sink_full=0.9)
    assert w.concurrency == 2, w.decisions
    w.window(0.3, rate=1000, cores=1.0, task=0.004, sink_full=0.9)
    assert "back to 4, 2 was slower" in w.decisions
    assert w.concurrency == 4
    # Where the consumer takes 400 a second, 2 calls of 4 ms (500 a second) are enough.
    w = Windows(concurrency=4)
    w.window(0.3, rate=400, cores=1.0, task=0.01, sink_full=0.9)  # 4 calls, 400 a second
    w.window(0.3, rate=400, cores=1.0, task=0.004, sink_full=0.9)
    assert "4 -> 2 kept, as fast" in w.decisions


def test_the_window_after_a_put_back_does_not_clear_the_ceiling() -> None:
    # It ends the trial's last calls, longer than calls at the value put back: not a change
    # of conditions. Calls longer in the window after that are.
    w = Windows(concurrency=4)
    w.window(0.3, rate=1000, cores=0.5, task=0.004)
    w.window(0.3, rate=1000, cores=0.5, task=0.004)  # 8 did not pay: back to 4
    assert (w.concurrency, w.knob.ceiling) == (4, 8), w.decisions
    # Half the slots busy: nothing raised or trimmed, the ceiling only checked.
    w.window(0.3, rate=1000, cores=0.5, task=0.012, busy=0.5)  # the tails of the 8
    assert w.knob.ceiling == 8
    w.window(0.3, rate=1000, cores=0.5, task=0.012, busy=0.5)  # calls 3 times as long
    assert w.knob.ceiling is None
    assert w.knob.jump == 12  # three times the calls: the rate it had at 4


def test_a_queue_between_two_tuned_stages_keeps_room_for_the_larger() -> None:
    # 64 reads feed 2 decodes: a trial of the decode at 4, put back at 2, must leave the
    # queue between them at 64 (it went down to the build's size, and the reads waited).

    stages = [Stage(1), Stage(4), Stage(2)]
    channels = [Channel(f"{i}->", 4, Growth(4, 1024, 1 << 30) if i < 2 else None) for i in range(3)]
    read, decode = Knob(stages[1], 1, 1, 128), Knob(stages[2], 2, 1, 8)
    tuner = Tuner([read, decode], channels, Tuning(cpu_budget=2), stages)
    tuner._set(read, 64)
    assert channels[0].capacity == channels[1].capacity == 64
    tuner._set(decode, 4)
    tuner._set(decode, 2)
    assert channels[1].capacity == 64
    tuner._set(read, 8)  # and the read lowered: the queue shrinks to what it needs
    assert channels[1].capacity == 8


def test_a_stage_halved_for_the_memory_budget_frees_the_queue_before_it() -> None:
    # 64 reads of 100 KiB feed 8 decodes of 4 MiB results, 40 MiB allowed: halving the
    # decode to 4 fits, with the queue between them at its first size (sized for the reads
    # instead, it took 6 MiB back, and the decode was halved once more).

    stages = [Stage(1), Stage(4), Stage(8)]
    channels = [Channel(f"{i}->", 4, Growth(4, 1024, 1 << 40) if i < 2 else None) for i in range(3)]
    read, decode = Knob(stages[1], 1, 1, 128), Knob(stages[2], 2, 1, 8)
    tuner = Tuner([read, decode], channels, Tuning(cpu_budget=2, memory_budget=40 << 20), stages)
    tuner._set(read, 64)
    tuner._sizes[1].nbytes, tuner._sizes[2].nbytes = 100 << 10, 4 << 20
    tuner._keep_within(40 << 20)
    assert tuner._held_bytes() <= 40 << 20
    assert (read.concurrency, decode.concurrency) == (64, 4), tuner.decisions
    assert channels[1].capacity == 4


@pytest.mark.parametrize(("cores", "kept"), [(0.3, True), (1.5, False)])
def test_a_raise_of_calls_that_wait_is_kept_for_a_small_gain(cores: float, kept: bool) -> None:
    # Two calls of 10 ms in flight on 0.3 cores wait more than they compute: doubling them
    # for 6 % more is kept. The same calls on 1.5 busy cores compute: a doubling must bring
    # a quarter more.
    w = Windows(concurrency=2)
    w.window(0.3, rate=1000, cores=cores, task=0.01)
    assert w.concurrency == 4, w.decisions
    w.window(0.3, rate=1060, cores=cores, task=0.01)
    assert ("2 -> 4 kept" in w.decisions) is kept, w.decisions
    assert (w.concurrency >= 4) is kept, w.decisions  # kept, it may go on up


def test_a_ceiling_from_before_calls_slowed_goes_with_the_next_raise_kept() -> None:
    # Reads of 10 ms settle at 16 (32 did not pay); then the store slows to 100 ms. The
    # first window after a put-back does not judge conditions (its calls include the
    # trial's), so the read goes halfway to its old ceiling, 24, and that raise pays: the
    # ceiling, found at 10 ms, must go with it (it held the read at 24 for 30 s, a tenth of
    # the rate it could have).
    w = Windows(concurrency=16)
    w.knob.high = 256
    w.window(0.3, rate=1000, cores=0.3, task=0.01)
    assert w.concurrency == 32, w.decisions
    w.window(0.3, rate=1010, cores=0.3, task=0.01)  # did not pay: put back, ceiling 32
    assert (w.concurrency, w.knob.ceiling) == (16, 32), w.decisions
    w.window(0.3, rate=160, cores=0.05, task=0.1)  # the store slowed down
    for _ in range(6):
        rate = w.concurrency / 0.1
        w.window(0.3, rate=rate, cores=0.05, task=0.1)
    assert w.concurrency > 32, w.decisions


def _slowed_store_kept_at_24(sink_full: float = 0.0) -> Windows:
    # Reads of 10 ms at 16 (32 did not pay); the store slows to 100 ms; in the window after
    # the put-back the read goes halfway to its old ceiling, 24, and that raise is kept.
    w = Windows(concurrency=16)
    w.knob.high = 4096
    w.window(0.3, rate=1000, cores=0.3, task=0.01)
    w.window(0.3, rate=1010, cores=0.3, task=0.01)  # 32 did not pay: back to 16
    w.window(0.3, rate=160, cores=0.05, task=0.1)  # the store slowed down: 16 -> 24
    assert w.concurrency == 24, w.decisions
    w.window(0.3, rate=240, cores=0.05, task=0.1, sink_full=sink_full)  # kept
    assert "16 -> 24 kept" in w.decisions, w.decisions
    assert w.knob.ceiling is None, w.decisions
    return w


def test_a_ceiling_dropped_for_calls_ten_times_longer_sends_the_next_raise_ten_times_up() -> None:
    # Once the ceiling found at 10 ms is gone, the calls taking ten times as long: the next
    # raise (in the same window) goes to ten times the 16 calls the stage had before it
    # (Little's law: the rate it had), not to twice the 24 it has.
    w = _slowed_store_kept_at_24()
    assert w.concurrency == 160, w.decisions


def test_calls_made_longer_by_a_raise_itself_do_not_send_the_next_raise_up_as_far() -> None:
    # After the jump, the server is at its limit: calls take about as much longer as there
    # are more of them, and the raise is still kept (its output grew a tenth). That is no
    # change of conditions: the next raise doubles, it does not jump again (measured on a
    # model of such a server: 24 -> 240 -> 2134 calls for a quarter more items).
    w = _slowed_store_kept_at_24()
    jumped = w.concurrency
    w.window(0.3, rate=265, cores=0.05, task=0.1 * jumped / 24 * 0.9)
    assert f"24 -> {jumped} kept" in w.decisions, w.decisions
    assert jumped < w.concurrency <= 2 * jumped, w.decisions


def test_a_jump_not_taken_soon_lapses() -> None:
    # The jump holds for the raise that follows the change, not for one many windows later
    # (the consumer was the slower side meanwhile, or another stage was raised): conditions
    # may have changed again since.
    w = _slowed_store_kept_at_24(sink_full=0.9)  # kept; the consumer is the slower side
    assert w.concurrency <= 24, w.decisions
    for _ in range(4):
        w.window(0.3, rate=240, cores=0.05, task=0.1, sink_full=0.9)
    c = w.concurrency
    for _ in range(3):
        w.window(0.3, rate=w.concurrency / 0.1, cores=0.05, task=0.1)
        if w.concurrency > c:
            break
    assert c < w.concurrency <= 2 * c, w.decisions


def test_a_ceiling_stays_when_only_the_raise_made_the_calls_longer() -> None:
    # A ceiling of 32 found at 10 ms; in the window after a put-back the stage at 4 goes
    # halfway to it, 18, and its calls take three times as long there (a server at its
    # limit) while the output still grows: no change of conditions, the ceiling stays and
    # the next raise goes halfway to it again.
    w = Windows(concurrency=4)
    w.knob.high = 4096
    w.knob.ceiling, w.knob.ceiling_task = 32, 0.01
    w.knob.ceiling_at = time.perf_counter()
    w.knob.settle_window = w.tuner._windows + 1
    w.window(0.3, rate=400, cores=0.05, task=0.01)  # 4 -> 18
    assert w.concurrency == 18, w.decisions
    w.window(0.3, rate=440, cores=0.05, task=0.03)  # kept: 600 calls/s against 400
    assert "4 -> 18 kept" in w.decisions, w.decisions
    assert w.knob.ceiling == 32, w.decisions
    assert w.concurrency <= 25, w.decisions


def test_a_raise_after_a_window_that_ended_no_call_still_drops_a_stale_ceiling() -> None:
    # Calls of seconds: the window before the raise ended none, so the time after the raise
    # alone says that conditions changed.
    w = Windows(concurrency=16)
    w.knob.high = 4096
    w.window(0.3, rate=1000, cores=0.3, task=0.01)
    w.window(0.3, rate=1010, cores=0.3, task=0.01)  # 32 did not pay: back to 16
    w.window(0.3, rate=160, cores=0.05, task=0)  # the store slowed down: no call ended
    assert w.concurrency == 24, w.decisions
    w.window(0.3, rate=240, cores=0.05, task=0.1)  # kept
    assert "16 -> 24 kept" in w.decisions, w.decisions
    assert w.knob.ceiling is None, w.decisions
