"""The statistics every benchmark scenario shares."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from feedline.bench._common import Contender, alternate


def _rates(values: list[float]) -> Callable[[], tuple[int, float]]:
    it: Iterator[float] = iter(values)
    return lambda: (int(next(it)), 1.0)


def test_alternate_runs_round_robin_and_pairs_ratios_by_round() -> None:
    order: list[str] = []

    def tracked(name: str, values: list[float]) -> Contender:
        run = _rates(values)

        def wrapped() -> tuple[int, float]:
            order.append(name)
            return run()

        return Contender(name, wrapped)

    # The machine slows in round 2: the baseline's median (90) and the contender's (150) are
    # from different rounds; round by round the contender is 1.5x, 2.0x and 2.2x as fast.
    found = alternate(
        "case",
        [tracked("base", [100, 60, 90]), tracked("fast", [150, 120, 200])],
        3,
        "base",
    )
    assert order == ["base", "fast"] * 3
    by_name = {m.contender: m for m in found}
    assert by_name["base"].items_per_s == 90
    assert by_name["fast"].items_per_s == 150
    assert by_name["fast"].runs == [150, 120, 200]
    assert by_name["base"].ratio == 1.0
    assert by_name["fast"].ratio == pytest.approx(2.0)


def test_alternate_without_a_baseline_leaves_ratios_unset() -> None:
    found = alternate("case", [Contender("only", _rates([5, 7]))], 2, None)
    assert found[0].ratio is None
    assert found[0].items_per_s == 6
