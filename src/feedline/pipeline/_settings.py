"""Every number the engine runs by, named and explained once.

Grouped by what they govern. The modules import them from here; a test that needs another
value patches the name in the module that uses it. Sizes are in items unless they say bytes;
times in seconds.
"""

from __future__ import annotations

# -- threads --------------------------------------------------------------------------------

MAX_DEFAULT_THREADS = 64
"""The most threads ``build()`` gives the pool when ``num_threads`` is not set (it gives one per
slot of the sync stages; a sync source has a thread of its own)."""

# -- queues and their growth ----------------------------------------------------------------

DEFAULT_SINK = 3
"""Finished items held for the consumer by default (two per slot of a wider last stage)."""

MAX_DEFAULT_SINK = 64
"""The most a default sink holds, however wide the last stage (say, 256 reads in flight)."""

MAX_DEFAULT_QUEUE = 512
"""The most a default queue between two stages grows to: after a cheap source and before a cheap
stage it gets there, unless its byte budget stops it first."""

SINK_GROW_BYTES = 64 << 20
"""A default sink grows only while the items it would hold come to at most this many bytes."""

QUEUE_GROW_BYTES = 16 << 20
"""A default queue between two stages grows only while the items it would hold come to at most
this many bytes."""

UNKNOWN_SIZE_CAP = 16
"""The most a growing queue holds of items whose size ``approx_nbytes`` cannot tell."""

NUMBER_BYTES = 32
"""What ``approx_nbytes`` counts for a Python number: the object (24 to 32 bytes) and its place
in the list or dict that holds it (8), so that lists of token ids count toward a byte budget."""

RECHECK = 64
"""A grown queue measures one item in this many against its byte budget, and shrinks if over."""

MAX_QUIET = 4096
"""The most items a queue takes without asking to grow after doublings that changed nothing."""

QUEUE_SPAN = 8e-3
"""A queue between stages grows while the doubled queue holds less than this many seconds of its
consumer's calls at the consumer's concurrency. Its producer is woken when it has drained to
half, and must refill it before the other half is gone: on cores the stages keep busy, that
wake-up took 0.1-0.3 ms at the median, 1-2 ms at the 99th percentile and up to 8 ms
(``numpy.load`` at two threads on 2 cores; the GIL adds to it). A queue of 1 ms of calls left
the consumer waiting for its input 15-28 % of the time there."""

SIZE_FALL = 0.125
"""How far the bytes per item a queue is sized for fall toward a smaller item measured (they
rise at once): items of mixed sizes are sized for the large ones."""

# -- cheap stages ---------------------------------------------------------------------------

CHEAP_BELOW = 20e-6
"""A stage whose op takes less than this (smoothed) is cheap: a thread wake-up costs more than a
call, so a coroutine one takes its input in bursts, and the queues around it may grow."""

BURST = 16
"""Items a cheap coroutine stage takes from its input at once and starts in turn, handing the
results on together: one lock round trip and one wake-up of the next stage serve them all."""

BURST_ABORT = 200e-6
"""A coroutine call that takes longer than this without waiting ends the burst it is part of:
the stage was cheap but no longer is, and the results made so far go on at once."""

EAGER_WORKERS = 64
"""Worker coroutines an async stage starts at once; past these, one more starts whenever work
is taken and none waits, up to the stage's concurrency. Making them all at the start cost 40
ms before a DataLoader's first batch at 2,048 (batches of one item); starting every one as
work came cost 25% of the rate of 3 no-op async stages at concurrency 8."""

# -- the consumer ---------------------------------------------------------------------------

TAKE_SECONDS = 0.5e-3
"""Seconds of calls (by their smoothed time) a job of an unordered threaded stage takes from its
input at once: cheap calls then pay one lock of the input and one count of their stage for
several items. Each result goes on as it is made, so a take delays nothing that is done."""

TAKE_MOST = 8
"""The most items a take holds, however cheap the calls (and no more than the output has room
for)."""

CONSUMER_SPIN = 100e-6
"""Seconds the consumer yields (``sleep(0)``) before it sleeps, behind an event-loop stage and
while items lately came within that time: a producer in mid-burst delivers the next item
sooner than a sleep and a wake-up (50-400 us on virtual machines) would take. Not behind
threaded stages, whose threads would lose the CPU the spin takes."""

CONTINUOUS_AHEAD = 1024
"""A continuous run reads at most this many source items past the consumer's epoch."""

SOURCE_POLL = 0.1
"""How often a pipeline used as another's source checks whether its reader stopped, and a
continuous run's consumer whether its epoch ended with no item coming."""

RESUME_SKIP_CHECK = 256
"""Items a resumed source skips between two looks at whether the run is stopping."""

DURATION_RING = 2048
"""Call durations kept per stage, for the percentiles in ``stats()``."""

# -- stopping -------------------------------------------------------------------------------

STOP_WARN_AFTER = 5.0
"""A stop that waits this long on calls still running logs a warning (and again as often).
On Ctrl-C or at exit a stop waits only ``feedline._grace.STOP_GRACE`` s (shared with the
DataLoader's threads)."""

MIXTURE_JOIN_SECONDS = 5.0
"""How long leaving a ``Mixture`` waits for a source thread stuck in its source."""

# -- stages that may move to processes (executor="auto") ----------------------------------

PROBE_LIMIT = 30.0
"""Seconds a move waits for its workers to start and unpickle the op before it gives up."""

PICKLE_LIMIT = 1 << 20
"""An op whose pickle is larger than this many bytes stays on threads: it travels with every
item (a bound method of a large dataset)."""

CHUNK_SECONDS = 2e-3
"""Seconds of calls (as measured on threads) a chunk sent to a worker aims at: a hand-off
(pickles, a pipe each way, a thread's wake-up: about 100 us) is then a few percent of it."""

MAX_CHUNK = 16
"""The most items sent to a worker in one message."""

# -- the tuner's decisions (``_decide``): thresholds of its rules -------------------------

GAIN = 1.05
"""A raise is kept if the output rate grew by this factor at least (measured noise of a
window on two shared cores: +-8 %, so smaller gains are not told from noise)..."""

SHARE = 0.25
"""... and by this share of the raise (a doubling: a quarter more), so that a raise that does
not pay is not kept on a lucky window."""

JUDGED_RAISE = 4.0
"""A raise of more than this many times must bring what a raise of this many times must."""

WAITING = 4.0
"""A stage with this many calls in flight per core the process kept busy waits more than it
computes: its raise needs only :data:`GAIN` (calls that wait cost memory, not cores; a read
raised from 32 to 64 for 6 % was held at 40 otherwise)."""

COMPUTES = 0.25
"""Calls that kept this share of a core busy each, or more, compute (or hold the GIL): a raise
of them kept against the run's first window is tried back (the start-up, not the raise, may
have brought the gain). Calls that wait leave the cores idle (reads of 20 ms: 0.02 a call),
and their raise stands."""

KEEP_LOWER = 0.97
"""Fewer calls are kept if the output stays at this share of its rate, and the stage can still
end this share of the calls it ended before (items queued behind it hide a cut for a window)."""

BUSY = 0.6
"""A stage is raised only if its calls filled this share of its slots."""

BLOCKED = 0.5
"""A stage whose output (or a sink) was full this share of the window is held up downstream."""

BUSY_CPU = 0.95
"""From this share of the CPU budget busy on, nothing is raised: more calls would queue for
the cores (not lower: beside a server on 2 cores, decode still paid from 1.8 cores busy)."""

COLD_CPU = 0.8
"""The run's first window raises only below this share of the CPU budget: its rate, held down
by the start-up, makes any raise on busy cores look as if it paid (a JPEG decode went from
one call per core to two that way, 15 % slower)."""

LOWER_CORES = 0.9
"""After a raise that did not pay, the stage is tried at half, but not below this share of the
cores the process kept busy (a decode at one call per core halved would leave cores idle)."""

CONTENTION = 0.5
"""A raise of R times whose calls grew more than R ** CONTENTION times found contention (the
GIL, busy cores, a server at its limit): fewer calls are tried. Calls about as long wait on
something fewer would not shorten: fewer are tried only if they could still end as many."""

CHANGED = 2.0
"""Calls this many times longer or shorter than at the concurrency kept: conditions changed
(a slower server, larger items), and what did or did not pay before may differ now."""

CEILING_TTL = 30.0
"""Seconds a ceiling or floor holds at most: found in one noisy window, it is tried again."""

JUMP_WINDOWS = 3
"""Windows for which calls that became F times longer let the next raise go to F times the
calls in flight; later, conditions may have changed again."""

FEED_MARGIN = 1.25
"""A stage feeding a tuned stage that waits for items goes to this many times the calls in
flight that stage's capacity needs (a 30 ms read feeding two 2.5 ms decodes: 2 -> 16)."""

FEED_MOST = 8
"""The most times its concurrency a raise to feed the next stage goes at once (a next stage
of microseconds would ask for thousands)."""

TRIM_AFTER = 3
"""Windows in a row a stage must use few of its slots before it is lowered."""

MOVE_CPU = 0.35
"""A stage whose calls on threads kept this many cores busy, or more, computes: if more calls
did not pay while cores stayed idle, the GIL holds it back (calls that wait use little CPU,
and processes would not help them)."""

MOVE_GIL = 1.25
"""... and at most this many: under the GIL, threads of Python code keep one core busy at the
most, whatever their number (a decode that releases it keeps all the cores busy, and would
gain nothing from processes)."""

MOVE_WAITED = 0.75
"""... and computed at most this share of the time each call ran: under the GIL a call waits
for it part of the time (a decode that releases it computes throughout, and a stage starved
by a slow read upstream is not held back by the GIL)."""

MOVE_ROOM = 0.1
"""... and not while the whole machine leaves less than this many cores idle: the calls then
wait for cores that other processes keep busy, not for the GIL."""

MOVE_IDLE = 0.5
"""Cores of the CPU budget that must be idle for a move to processes to have room to pay."""

MOVE_GAIN = 1.1
"""A move to processes is kept if the output rate grew by this factor (a process hop costs
a pickle and a wake-up per item: a smaller gain is not worth it, nor told from noise)."""

# A move that did not pay is tried again after RETRY_AFTER seconds, twice as long after each
# later one, RETRY_MOST at most: the DataLoader's schedule for num_workers="auto" too
# (feedline/_retry.py).

# -- the tuner's windows (``_tuner``) -----------------------------------------------------

MIN_WINDOW = 0.25
"""Seconds a window lasts at least (and three of the slowest tuned op's calls): shorter ones
are mostly noise."""

FIRST_WINDOW = 0.1
"""Seconds of the run's first window, whatever came out: it only decides a raise, and a cold
start at a few calls in flight, its first calls slow, is where waiting costs most."""

MAX_WINDOW = 2.0
"""Seconds a window lasts at most, however few items came out."""

MIN_ITEMS = 8
"""Items out a window needs before it closes (unless it reached :data:`MAX_WINDOW`)."""

SIZE_EVERY = 8
"""With a memory budget, one item in this many put in each queue is measured."""

# -- tuned concurrency (``_tuning``) ------------------------------------------------------

THREAD_HIGH = 32
"""The most calls a tuned stage on threads runs at once, unless its ``Auto`` says otherwise."""

LOOP_HIGH = 256
"""The most calls a tuned coroutine stage (on the event loop) runs at once, by default."""
