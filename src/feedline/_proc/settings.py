"""Every number the process machinery runs by, named and explained once.

Times in seconds. A test that needs another value patches the name in the module that uses it.
"""

from __future__ import annotations

# -- child processes ------------------------------------------------------------------------

CHILD_POLL = 0.2
"""Seconds between checks that a child process is alive while waiting for it."""

CHILD_STARTUP_SECONDS = 120.0
"""The least a child process gets to start and make its iterable."""

CHILD_CLOSE_GRACE = 0.3
"""Seconds a child gets to leave by itself before it is terminated."""

CHILD_DRAIN_SECONDS = 2.0
"""Seconds a child left in mid-epoch (``break``) gets to finish its item and stay."""

SHM_MIN_BYTES = 64 * 1024
"""Arrays at least this large cross from a child in shared memory rather than pickled."""

# -- the pipe-fed pool ----------------------------------------------------------------------

POOL_CLOSE_GRACE = 0.5
"""Seconds a closing ``PipePool`` gives its idle workers to end on their own."""

WRITEV_BUFFERS = 64
"""The most buffers a pool worker hands to one ``writev``."""
