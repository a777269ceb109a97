"""Every number the engine runs by, named and explained once.

Grouped by what they govern. The modules import them from here; a test that needs another
value patches the name in the module that uses it. Sizes are in items unless they say bytes;
times in seconds.
"""

from __future__ import annotations

# -- threads --------------------------------------------------------------------------------

MAX_DEFAULT_THREADS = 64
"""The most threads ``build()`` gives the pool when ``num_threads`` is not set (it gives one per
slot of the sync stages, plus one for the source)."""

# -- queues and their growth ----------------------------------------------------------------

DEFAULT_SINK = 3
"""Finished items held for the consumer by default (two per slot of a wider last stage)."""

MAX_DEFAULT_SINK = 64
"""The most a default sink holds, however wide the last stage (say, 256 reads in flight), and
the most a default queue grows to."""

SINK_GROW_BYTES = 64 << 20
"""A default sink grows only while the items it would hold come to at most this many bytes."""

QUEUE_GROW_BYTES = 16 << 20
"""A default queue between two stages grows only while the items it would hold come to at most
this many bytes."""

UNKNOWN_SIZE_CAP = 16
"""The most a growing queue holds of items whose size ``approx_nbytes`` cannot tell."""

RECHECK = 64
"""A grown queue measures one item in this many against its byte budget, and shrinks if over."""

MAX_QUIET = 4096
"""The most items a queue takes without asking to grow after doublings that changed nothing."""

QUEUE_SPAN = 1e-3
"""A queue between stages whose consumer is not cheap grows while it holds less than this many
seconds of the consumer's calls: a turn of the producer (a wake-up, tens of microseconds) per
half of it is then a few percent of the work at most."""

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

CONSUMER_SPIN = 100e-6
"""Seconds the consumer yields (``sleep(0)``) before it sleeps, behind an event-loop stage and
while items lately came within that time: a producer in mid-burst delivers the next item
sooner than a sleep and a wake-up (50-400 us on virtual machines) would take. Not behind
threaded stages, whose threads would lose the CPU the spin takes."""

CONTINUOUS_AHEAD = 1024
"""A continuous run reads at most this many source items past the consumer's epoch."""

SOURCE_POLL = 0.1
"""How often a pipeline used as another's source checks whether its reader stopped."""

RESUME_SKIP_CHECK = 256
"""Items a resumed source skips between two looks at whether the run is stopping."""

DURATION_RING = 2048
"""Call durations kept per stage, for the percentiles in ``stats()``."""

# -- stopping -------------------------------------------------------------------------------

STOP_WARN_AFTER = 5.0
"""A stop that waits this long on calls still running logs a warning (and again as often)."""

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
