"""Which holder of a replicated sample trains on it: an exact assignment, by maximum flow.

Where the caches have room for second copies, a sample of a batch may be trained on by
either of its holders. Choosing well lowers what must be exchanged: every rank should get
as close to its local batch size as its holdings allow. Start with each sample at its first
holder; a rank over its size can hand a replicated sample to the sample's other holder, who
may in turn hand one of its own on, and so on. The most samples that can reach ranks short of
their size this way is a maximum flow from the ranks over their size to the ranks under it,
through edges whose capacity is the number of samples one rank could hand the other (Dinic's
algorithm on the ranks' graph). Whatever remains short is exchanged, as without replicas.
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

__all__ = ["spread"]


def spread(first: np.ndarray, second: np.ndarray, world: int, wanted: int) -> np.ndarray:
    """Each sample's trainer: ``first[i]``, or ``second[i]`` (``-1``: no second copy).

    The result maximises the samples trained by a rank at or under ``wanted`` (so it
    minimises the exchange that follows); ties keep samples at their first holder.
    """
    owner = first.astype(np.int64, copy=True)
    load = np.bincount(owner, minlength=world)
    movable: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i in np.nonzero(second >= 0)[0].tolist():
        movable[int(first[i])][int(second[i])].append(i)
    source, sink = world, world + 1
    capacity: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for u, targets in movable.items():
        for v, samples in targets.items():
            capacity[u][v] += len(samples)
    for rank in range(world):
        if load[rank] > wanted:
            capacity[source][rank] = int(load[rank] - wanted)
        elif load[rank] < wanted:
            capacity[rank][sink] = int(wanted - load[rank])
    flow = _max_flow(capacity, source, sink, world + 2)
    for u, targets in movable.items():
        for v, samples in targets.items():
            net = flow[u][v] - flow[v][u]
            if net > 0:  # hand ``net`` of u's samples that v also holds over to v
                owner[samples[:net]] = v
    return owner


def _max_flow(
    capacity: dict[int, dict[int, int]], source: int, sink: int, nodes: int
) -> dict[int, dict[int, int]]:
    """Dinic's maximum flow; returns the flow on each edge (both directions kept)."""
    flow: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    neighbours: dict[int, set[int]] = defaultdict(set)
    for u, targets in capacity.items():
        for v in targets:
            neighbours[u].add(v)
            neighbours[v].add(u)  # the residual edge back
    adjacency = {u: sorted(vs) for u, vs in neighbours.items()}

    def residual(u: int, v: int) -> int:
        return capacity[u][v] - flow[u][v] + flow[v][u]

    while True:
        level = [-1] * nodes
        level[source] = 0
        queue = deque([source])
        while queue:
            u = queue.popleft()
            for v in adjacency.get(u, ()):
                if level[v] < 0 and residual(u, v) > 0:
                    level[v] = level[u] + 1
                    queue.append(v)
        if level[sink] < 0:
            return flow
        cursor = dict.fromkeys(adjacency, 0)

        def push(
            u: int, limit: int, level: list[int] = level, cursor: dict[int, int] = cursor
        ) -> int:
            if u == sink:
                return limit
            edges = adjacency.get(u, [])
            while cursor[u] < len(edges):
                v = edges[cursor[u]]
                room = residual(u, v)
                if room > 0 and level[v] == level[u] + 1:
                    sent = push(v, min(limit, room))
                    if sent:
                        back = min(sent, flow[v][u])  # cancel flow the other way first
                        flow[v][u] -= back
                        flow[u][v] += sent - back
                        return sent
                cursor[u] += 1
            return 0

        while push(source, 1 << 62):
            pass
