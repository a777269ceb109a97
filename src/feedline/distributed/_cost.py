"""The cost model of the locality-aware loading paper, equations (1) to (8).

The paper's variables, per epoch (rates in samples per second):

- ``D``: samples in the dataset; ``p``: ranks (learners);
- ``V``: one rank's training rate; ``U``: one rank's preprocessing rate (decode, augment);
- ``R``: the storage system's rate (all ranks together: the shared file system's limit);
- ``R_c``: the rate of reads from other ranks' caches; ``R_b``: the rate of the exchange
  that balances a batch (``R_c`` by default);
- ``alpha``: the share of the dataset the ranks' caches hold together;
- ``beta``: the share of each global batch the locality-aware method exchanges.

Two terms go beyond the paper, for the locality-aware method's per-step costs (both 0 by
default, which is the paper's model): ``L_b``, the time of one balancing exchange round beyond
moving its bytes (a round trip of headers before the payloads), paid by the steps that move
anything; and ``L_plan``, the time to plan one step on one rank. With a fast network and small
batches these dominate ``beta D / R_b``; :func:`measure_exchange` measures ``L_b`` and ``R_b``
on a process group.

Loading overlaps training, so an epoch costs the larger of its training time and its
loading time. The regular loader reads everything from storage each epoch; a distributed
cache reads the cached share from other ranks (all but ``1/p`` of it); the locality-aware
method reads only the uncached share from storage and moves ``beta`` of what is cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["CostModel", "Method", "expected_beta"]

Method = Literal["regular", "distributed cache", "locality-aware"]


def expected_beta(p: int, b: int) -> float:
    """The expected exchanged share of a global batch of ``p * b`` samples.

    Each rank holds a uniformly random ``1/p`` of the dataset, so the samples of a batch it
    holds are Binomial(``p * b``, ``1/p``), and Algorithm 1 moves the sum of the ranks'
    deficits: ``beta = E[max(0, b - X)] / b``, summed exactly over the binomial. For large
    ``b`` this is ``sqrt((1 - 1/p) / (2 pi b))``: 7.0 % at ``b = 32``, 5.0 % at 64, 3.5 %
    at 128.
    """
    if p < 1 or b < 1:
        raise ValueError(f"p and b must be positive, got p={p}, b={b}")
    if p == 1:
        return 0.0
    n, q = p * b, 1.0 / p
    log_q, log_r = math.log(q), math.log1p(-q)
    log_norm = math.lgamma(n + 1)
    shortfall = 0.0
    for k in range(b):
        log_pmf = log_norm - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_q
        shortfall += (b - k) * math.exp(log_pmf + (n - k) * log_r)
    return shortfall / b


@dataclass(frozen=True)
class CostModel:
    """Equations (1) to (8) of the locality-aware loading paper, with its variable names.

    Rates are in samples per second, times in seconds per epoch.

    Attributes:
        D: Samples in the dataset.
        V: One rank's training rate.
        R: The storage system's rate, all ranks together (a shared file system's limit).
        U: One rank's preprocessing rate (decoding, augmenting).
        R_c: The rate of reads from other ranks' caches.
        alpha: The share of the dataset that the ranks' caches hold together.
        R_b: The rate of the exchange that balances a batch (default: ``R_c``).
        b: The local batch size: ``D / (p b)`` steps per epoch, and ``beta`` when a method
            is not given one.
        L_b: Seconds one balancing exchange round takes beyond moving its bytes (not in the
            paper: 0).
        L_plan: Seconds one rank takes to plan one step (not in the paper: 0).

    """

    D: float
    V: float
    R: float
    U: float
    R_c: float
    alpha: float = 1.0
    R_b: float | None = None
    b: int = 32
    L_b: float = 0.0
    L_plan: float = 0.0

    def __post_init__(self) -> None:
        for name in ("D", "V", "R", "U", "R_c"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if isinstance(self.b, bool) or not isinstance(self.b, int) or self.b < 1:
            raise ValueError(f"b is the local batch size, an int >= 1; got {self.b!r}")
        for name in ("L_b", "L_plan"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} is a time, >= 0; got {getattr(self, name)!r}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha is a share of the dataset, in [0, 1]; got {self.alpha!r}")

    def training_time(self, p: int) -> float:
        """(1): ``D / (p V)``."""
        return self.D / (p * self.V)

    def storage_time(self) -> float:
        """(2): the regular loader's sample I/O, ``D / R`` whatever ``p``."""
        return self.D / self.R

    def preprocessing_time(self, p: int) -> float:
        """(3): ``D / (p U)``."""
        return self.D / (p * self.U)

    def loading_time(self, p: int, method: Method = "regular", beta: float | None = None) -> float:
        """(4) for the regular loader; with (7) or (8) as the sample I/O for the others."""
        return self.io_time(p, method, beta) + self.preprocessing_time(p)

    def crossover(self) -> float:
        """(5): the number of ranks ``R / V`` past which the regular loader's I/O dominates."""
        return self.R / self.V

    def io_time(self, p: int, method: Method = "regular", beta: float | None = None) -> float:
        """Sample I/O per epoch: (2) regular, (7) distributed cache, (8) locality-aware."""
        if method == "regular":
            return self.storage_time()
        storage = (1 - self.alpha) * self.D / self.R
        if method == "distributed cache":
            return storage + self.alpha * self.D / self.R_c * (p - 1) / p
        if method == "locality-aware":
            share = expected_beta(p, self.b) if beta is None else beta
            moved = self.alpha * self.D / (self.R_b or self.R_c) * share
            return storage + moved + self.balancing_latency(p, share)
        raise ValueError(f"unknown method {method!r}")

    def balancing_latency(self, p: int, beta: float | None = None) -> float:
        """The locality-aware method's per-step costs in an epoch (beyond the paper).

        ``steps * (L_plan + rounds * L_b)``, with ``D / (p b)`` steps and ``rounds`` the
        share of steps that move at least one sample, approximately ``1 - exp(-m)`` for a
        step that moves ``m = alpha beta p b`` samples on average (as if the moves were
        independent: a little high for few ranks, 0.96 against 0.90 at ``p = 2, b = 32``).
        """
        share = expected_beta(p, self.b) if beta is None else beta
        steps = math.ceil(self.D / (p * self.b))
        rounds = -math.expm1(-share * self.alpha * p * self.b)
        return steps * (self.L_plan + rounds * self.L_b)

    def epoch_time(self, p: int, method: Method = "regular", beta: float | None = None) -> float:
        """(6) generalised: the larger of training and loading (they overlap)."""
        return max(self.training_time(p), self.loading_time(p, method, beta))

    def plot(self, ranks: list[int], path: Path) -> Path | None:
        """Draw loading time per epoch against ranks, for the three methods, as a PNG.

        The training time (1) is drawn too; both axes are logarithmic. Returns ``None``
        when matplotlib is not installed.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        methods: tuple[Method, ...] = ("regular", "distributed cache", "locality-aware")
        for method in methods:
            ax.plot(ranks, [self.loading_time(p, method) for p in ranks], marker="o", label=method)
        ax.plot(ranks, [self.training_time(p) for p in ranks], "k--", label="training (1)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (p)")
        ax.set_ylabel("seconds per epoch")
        ax.set_title(
            f"loading time: D={self.D:,.0f}, R={self.R:,.0f}/s, R_c={self.R_c:,.0f}/s, "
            f"alpha={self.alpha:g}, b={self.b}",
            fontsize=8,
        )
        ax.legend(fontsize=8)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        return path
