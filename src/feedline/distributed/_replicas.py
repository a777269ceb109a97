"""Which holder of a replicated sample trains on it: an exact assignment, by maximum flow.

Where the caches have room for second copies, a sample of a batch may be trained on by
either of its holders. Choosing well lowers what must be exchanged: every rank should get
as close to its local batch size as its holdings allow. Start with each sample at its first
holder; a rank over its size can hand a replicated sample to the sample's other holder, who
may in turn hand one of its own on, and so on. The most samples that can reach ranks short of
their size this way is a maximum flow from the ranks over their size to the ranks under it,
through edges whose capacity is the number of samples one rank could hand the other.
Whatever remains short is exchanged, as without replicas.

The flow is Dinic's algorithm on the ranks' graph, arranged for a thousand ranks and a global
batch of a hundred thousand samples: the samples are grouped into edges with numpy, a first
flow straight from ranks over to ranks under is found with numpy, and each phase's level
graph is built with numpy, so that Python walks only the arcs of augmenting paths.
"""

from __future__ import annotations

import numpy as np

__all__ = ["spread"]


def spread(first: np.ndarray, second: np.ndarray, world: int, wanted: int) -> np.ndarray:
    """Each sample's trainer: ``first[i]``, or ``second[i]`` (``-1``: no second copy).

    The result maximises the samples trained by a rank at or under ``wanted`` (so it
    minimises the exchange that follows); ties keep samples at their first holder.
    """
    owner = first.astype(np.int64, copy=True)
    movable = np.flatnonzero(second >= 0)
    excess = np.bincount(owner, minlength=world) - wanted
    if movable.size == 0 or not (excess > 0).any() or not (excess < 0).any():
        return owner
    # The ranks' graph: an edge per (holder, other holder) pair, its capacity the samples
    # of the pair (grouped, in index order, so that the first ones move).
    code = owner[movable] * world + second[movable].astype(np.int64)
    order = np.argsort(code, kind="stable")
    grouped = code[order]
    starts = np.flatnonzero(np.concatenate(([True], grouped[1:] != grouped[:-1])))
    codes = grouped[starts]
    capacity = np.diff(np.append(starts, grouped.size))
    tail, head = codes // world, codes % world
    flow = _max_flow(tail, head, capacity, excess)
    # The net flow between two ranks: samples move one way only, the rest stay put.
    moving = np.flatnonzero(flow > 0)
    counts = flow[moving]
    reverse = head[moving] * world + tail[moving]
    found = np.minimum(np.searchsorted(codes, reverse), codes.size - 1)
    counts = counts - np.where(codes[found] == reverse, flow[found], 0)
    moving, counts = moving[counts > 0], counts[counts > 0]
    if counts.size:
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        picked = order[np.repeat(starts[moving], counts) + offsets]
        owner[movable[picked]] = np.repeat(head[moving], counts)
    return owner


def _max_flow(
    tail: np.ndarray, head: np.ndarray, capacity: np.ndarray, excess: np.ndarray
) -> np.ndarray:
    # The flow on each rank edge, from the ranks with excess > 0 to those with excess < 0.
    world = excess.size
    source, sink = world, world + 1
    over, under = np.flatnonzero(excess > 0), np.flatnonzero(excess < 0)
    tails = np.concatenate([tail, np.full(over.size, source), under])
    heads = np.concatenate([head, over, np.full(under.size, sink)])
    caps = np.concatenate([capacity, excess[over], -excess[under]])
    direct = _direct(tail, head, capacity, excess)
    sent = np.bincount(tail, weights=direct, minlength=world).astype(np.int64)
    got = np.bincount(head, weights=direct, minlength=world).astype(np.int64)
    start = np.concatenate([direct, sent[over], got[under]])
    return _dinic(tails, heads, caps, start, world + 2, source, sink)[: tail.size]


def _direct(
    tail: np.ndarray, head: np.ndarray, capacity: np.ndarray, excess: np.ndarray, rounds: int = 2
) -> np.ndarray:
    # A first flow, straight from ranks over their size to ranks under it (edges in tail order).
    flow = np.zeros(tail.size, dtype=np.int64)
    excess = excess.copy()
    for _ in range(rounds):
        room = capacity - flow
        edges = np.flatnonzero((room > 0) & (excess[tail] > 0) & (excess[head] < 0))
        if edges.size == 0:
            break
        src, dst = tail[edges], head[edges]
        give = _capped(src, room[edges], excess[src])
        order = np.argsort(dst, kind="stable")
        take = np.zeros(edges.size, dtype=np.int64)
        take[order] = _capped(dst[order], give[order], -excess[dst[order]])
        flow[edges] += take
        excess -= np.bincount(src, weights=take, minlength=excess.size).astype(np.int64)
        excess += np.bincount(dst, weights=take, minlength=excess.size).astype(np.int64)
    return flow


def _capped(group: np.ndarray, amount: np.ndarray, limit: np.ndarray) -> np.ndarray:
    # Each amount, cut so that each group's running total (groups contiguous) stays within
    # its limit (given per element).
    total = np.cumsum(amount)
    starts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    sizes = np.diff(np.append(starts, group.size))
    before = total - amount - np.repeat(total[starts] - amount[starts], sizes)
    return np.clip(limit - before, 0, amount)  # type: ignore[no-any-return]


def _dinic(
    tails: np.ndarray,
    heads: np.ndarray,
    caps: np.ndarray,
    start: np.ndarray,
    nodes: int,
    source: int,
    sink: int,
) -> np.ndarray:
    # Dinic's maximum flow from a feasible ``start`` flow; returns the flow on each edge.
    m = tails.size
    # Every edge and its reverse arc, sorted by tail once: each phase's arcs keep the order.
    tail = np.concatenate([tails, heads])
    perm = np.argsort(tail, kind="stable")
    tail = tail[perm]
    head = np.concatenate([heads, tails])[perm]
    residual = np.concatenate([caps - start, start]).astype(np.int64)[perm]
    place = np.empty(2 * m, dtype=np.int64)
    place[perm] = np.arange(2 * m)
    partner = place[np.where(perm < m, perm + m, perm - m)]
    while True:
        level = np.full(nodes, -1, dtype=np.int64)
        level[source] = 0
        depth = 0
        open_ = residual > 0
        while level[sink] < 0:
            live = open_ & (level[tail] == depth) & (level[head] < 0)
            reached = np.unique(head[live])
            if reached.size == 0:  # no augmenting path: an edge's flow is its reverse arc's
                flow = np.empty(2 * m, dtype=np.int64)
                flow[perm] = residual
                return flow[m:]
            depth += 1
            level[reached] = depth
        # The level graph, less the arcs that cannot lead to the sink.
        step = open_ & (level[head] == level[tail] + 1) & (level[tail] >= 0)
        useful = np.zeros(nodes, dtype=bool)
        useful[sink] = True
        for d in range(depth - 1, -1, -1):
            useful[tail[step & (level[tail] == d) & useful[head]]] = True
        kept = np.flatnonzero(step & useful[head] & useful[tail])
        pushed = _blocking_flow(kept, tail, head, residual, useful, nodes, source, sink)
        if pushed:
            used, amounts = pushed
            np.add.at(residual, partner[kept[used]], amounts)


def _blocking_flow(
    kept: np.ndarray,
    tail: np.ndarray,
    head: np.ndarray,
    residual: np.ndarray,
    useful: np.ndarray,
    nodes: int,
    source: int,
    sink: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    # Push along paths of the level graph (arcs ``kept``, in tail order) until none is left;
    # updates ``residual`` on those arcs and returns the arcs pushed along, with amounts.
    bounds = np.concatenate(([0], np.cumsum(np.bincount(tail[kept], minlength=nodes)))).tolist()
    head_of, tail_of = head[kept].tolist(), tail[kept].tolist()
    res = residual[kept].tolist()
    cursor, end = bounds[:-1], bounds[1:]
    alive = useful.tolist()
    used: list[int] = []
    amounts: list[int] = []
    path: list[int] = []
    node = source
    while True:
        if node == sink:
            amount = min([res[j] for j in path])
            for j in path:
                res[j] -= amount
            used += path
            amounts += [amount] * len(path)
            path.clear()
            node = source
            continue
        k, stop = cursor[node], end[node]
        while k < stop and (res[k] == 0 or not alive[head_of[k]]):
            k += 1
        cursor[node] = k
        if k < stop:
            path.append(k)
            node = head_of[k]
        elif node == source:
            break
        else:
            alive[node] = False  # a dead end for the rest of this phase
            node = tail_of[path.pop()]
    residual[kept] = res
    if not used:
        return None
    return np.asarray(used), np.asarray(amounts)
