"""torchdata's ``StatefulDataLoader`` beside feedline's ``DataLoader``, for the resume tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from feedline import DataLoader


def side_by_side(concurrency: int | str = 1) -> list[Callable[..., Any]]:
    """torchdata's loader, then feedline's at ``concurrency``, each called as a loader class.

    At 1, feedline's global random draws are PyTorch's, and so torchdata's.
    """
    return [StatefulDataLoader, functools.partial(DataLoader, fetch_concurrency=concurrency)]


def dataset_states(state: dict[str, Any]) -> list[Any]:
    """Per worker (one slot without workers), the dataset's state in a loader's state.

    feedline keeps a list; torchdata keeps the dataset's state, or its iterator's when the
    dataset is its own iterator, per worker snapshot.
    """
    if "version" in state:
        return list(state["dataset_state"])

    def own(part: dict[str, Any]) -> Any:
        fetcher = part.get("fetcher_state") or {}
        if part["dataset_state"] is None:
            return fetcher.get("dataset_iter_state")
        return part["dataset_state"]

    if "_snapshot" not in state:
        return [own(state)]
    snapshots = state["_snapshot"]["_worker_snapshots"]
    return [own(snapshots[f"worker_{w}"]) for w in range(len(snapshots))]
