"""Which rank keeps which sample: a hash every rank computes by itself, stable as ranks change.

A sample's holder is a jump consistent hash (Lamping and Veach, 2014) of the sample's index
and the run's seed over the world size: uniform over the ranks, computed from nothing but
those numbers (no directory to ship, no collective), and when the world grows from ``p`` to
``p + 1`` ranks only about ``1/(p + 1)`` of the samples change holder (when it shrinks, only
those of the ranks that left). A second copy, where the cache has room for replicas, goes to
a second hash over the other ranks.
"""

from __future__ import annotations

import numpy as np

__all__ = ["holders", "jump_hash", "mix64", "second_copies"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_JUMP = np.uint64(2862933555777941757)


def mix64(values: np.ndarray, salt: int) -> np.ndarray:
    """SplitMix64 of ``values + salt``: well-spread 64-bit keys from small integers."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(salt & 0xFFFFFFFFFFFFFFFF) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))  # type: ignore[no-any-return]


def jump_hash(keys: np.ndarray, buckets: int) -> np.ndarray:
    """The jump consistent hash of each 64-bit key over ``buckets`` buckets (int64 array)."""
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    keys = keys.astype(np.uint64, copy=True)
    out = np.zeros(keys.shape, dtype=np.int64)
    nxt = np.zeros(keys.shape, dtype=np.int64)
    active = np.arange(keys.size)
    with np.errstate(over="ignore"):
        while active.size:
            out[active] = nxt[active]
            k = keys[active] * _JUMP + np.uint64(1)
            keys[active] = k
            step = (out[active] + 1) * (float(1 << 31) / ((k >> np.uint64(33)) + 1).astype(float))
            nxt[active] = step.astype(np.int64)
            active = active[nxt[active] < buckets]
    return out


def holders(size: int, world: int, seed: int, replicas: int = 1) -> np.ndarray:
    """Each sample's holders, as a ``(replicas, size)`` array of ranks (int16 or int32).

    Row 0 is each sample's first holder, row 1 its second (a different rank), and so on;
    ``replicas`` is at most ``world``.
    """
    if not 1 <= replicas <= world:
        raise ValueError(f"replicas must be between 1 and the world size {world}, got {replicas}")
    index = np.arange(size, dtype=np.uint64)
    rows = [jump_hash(mix64(index, seed), world)]
    for copy in range(1, replicas):
        # A hash over the ranks not yet holding the sample, in rank order.
        taken = np.sort(np.stack(rows), axis=0)
        pick = jump_hash(mix64(index, seed + 0x5EED * copy), world - copy)
        for row in taken:  # shift past each rank already taken
            pick = pick + (pick >= row)
        rows.append(pick)
    # The smallest signed type that holds a rank and -1 (held nowhere): a step's plan gathers
    # the holders of a whole batch at random places, and a quarter of the bytes is a quarter
    # of the cache misses.
    dtype = np.int16 if world < 1 << 15 else np.int32
    return np.stack(rows).astype(dtype)


def second_copies(placed: np.ndarray, seed: int, share: float) -> np.ndarray:
    """Each sample's second holder where a hash-chosen ``share`` of them has one, else ``-1``.

    ``placed`` is :func:`holders` with two rows (or one: nobody has a second copy); a sample
    with no first holder (``-1``: not cached) has no second one either.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share is a share of the samples, in [0, 1]; got {share!r}")
    size = placed.shape[1]
    if placed.shape[0] < 2 or share == 0.0:
        return np.full(size, -1, dtype=placed.dtype)
    draw = mix64(np.arange(size, dtype=np.uint64), seed + 1) % np.uint64(1 << 20)
    chosen = (draw < np.uint64(round(share * (1 << 20)))) & (placed[0] >= 0)
    return np.where(chosen, placed[1], -1).astype(placed.dtype)
