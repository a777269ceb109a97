"""Locality-aware distributed loading: the planning it rests on.

Every rank trains on exactly the global mini-batch a regular distributed loader gives it
(``DistributedSampler`` + ``DataLoader``), but, after the first epoch, mostly from samples
it already holds: which rank holds which sample is a hash every rank computes
(:func:`holders`), and each step's plan (:func:`plan_step`, Algorithm 1 of the
locality-aware loading paper in :func:`balance`) says who trains on what and who sends
what to whom. :func:`simulate_beta` estimates the exchanged share without processes, and
:class:`CostModel` is the paper's cost model (equations 1 to 8) with it, and
:func:`measure_exchange` measures its exchange terms on a process group.

:class:`DistributedLoader` runs the plans over ``torch.distributed``: each rank reads what
it holds once (its cache keeps it), and then trains mostly on it.
"""

from feedline.source.stored import StoredSamples

from ._balance import balance
from ._calibrate import ExchangeCost, measure_exchange
from ._cost import CostModel, expected_beta
from ._exchange import ExchangeError, ExchangeTimeout
from ._loader import DistributedLoader, LoaderStats
from ._placement import holders
from ._plan import RankPlan, StepPlan, plan_for, plan_step
from ._sequence import GlobalSequence
from ._simulate import simulate_beta

__all__ = [
    "CostModel",
    "DistributedLoader",
    "ExchangeCost",
    "ExchangeError",
    "ExchangeTimeout",
    "GlobalSequence",
    "LoaderStats",
    "RankPlan",
    "StepPlan",
    "StoredSamples",
    "balance",
    "expected_beta",
    "holders",
    "measure_exchange",
    "plan_for",
    "plan_step",
    "simulate_beta",
]
