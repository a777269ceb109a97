"""What travels between ranks is checked: damaged or misplaced samples raise."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import numpy as np

from feedline.distributed import ExchangeError
from feedline.distributed._exchange import _pack, _unpack


def _roundtrip(header: object, payload: object, tag: int = 5) -> list[tuple[int, bytes | None]]:
    return _unpack(header.numpy(), payload.numpy(), tag, src=1, where="epoch 0, step 3")  # type: ignore[attr-defined]


def test_samples_and_unreadable_ones_cross_intact() -> None:
    samples = [b"alpha", None, bytes(range(256)) * 40, b""]
    header, payload = _pack(5, np.array([10, 11, 12, 13]), samples)
    assert _roundtrip(header, payload) == list(zip([10, 11, 12, 13], samples, strict=True))


@pytest.mark.parametrize("where", [0, 100, -1])
def test_a_flipped_byte_raises_naming_the_sample_and_the_sender(where: int) -> None:
    header, payload = _pack(5, np.array([10, 11]), [b"x" * 100, b"y" * 50])
    damaged = payload.clone()
    damaged[where] ^= 0xFF
    with pytest.raises(ExchangeError, match=r"sample 1[01] from rank 1 is damaged"):
        _roundtrip(header, damaged)


def test_a_short_payload_or_another_steps_header_raises() -> None:
    header, payload = _pack(5, np.array([10]), [b"x" * 100])
    with pytest.raises(ExchangeError, match="damaged"):
        _roundtrip(header, payload[:60])
    with pytest.raises(ExchangeError, match="another step"):
        _roundtrip(header, payload, tag=6)


def test_a_sample_of_another_step_raises_though_its_bytes_are_intact() -> None:
    from feedline.distributed._loader import _check_members, _Step
    from feedline.distributed._plan import RankPlan

    empty = np.array([], dtype=np.int64)
    step = _Step(2, 7, RankPlan(empty, empty, [], []), 0.0, np.array([4, 8, 15, 16]))
    header, payload = _pack(5, np.array([8, 15]), [b"a", b"b"])
    _check_members(step, {1: _roundtrip(header, payload)})  # members: accepted
    header, payload = _pack(5, np.array([8, 42]), [b"a", b"b"])
    with pytest.raises(
        ExchangeError, match="rank 1 sent sample 42, which is not in epoch 2, step 7"
    ):
        _check_members(step, {1: _roundtrip(header, payload)})


def _refused(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError(
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242. This is "
        "typically caused by a remote worker crashing.\nmore lines of gloo's own"
    )


def test_a_send_or_receive_that_a_dead_peer_refuses_raises_exchange_timeout() -> None:
    # gloo refuses to start a transfer on a connection the peer closed, before any wait;
    # that must read like a broken wait: which rank, what, which step, and what to look at.
    from feedline.distributed import ExchangeTimeout
    from feedline.distributed._exchange import Exchange

    exchange = Exchange(group=None, rank=0, timeout=5.0)  # no store: nothing is known
    with pytest.raises(ExchangeTimeout) as caught:
        what = "the send of 3 sample(s) to rank 2"
        exchange._post(_refused, None, 2, 14, what, "epoch 1, step 7")
    message = str(caught.value)
    assert "rank 0: the send of 3 sample(s) to rank 2 failed (epoch 1, step 7)" in message
    assert "Connection closed by peer [127.0.0.1]:4242. Rank 2 has gone" in message
    assert "which rank failed first is not known here" in message
    assert "crashing" not in message  # gloo's guess, which may be wrong
    assert "more lines" not in message


def test_a_broken_connection_names_the_first_failure_recorded_by_any_rank() -> None:
    # What every rank of a group would do with its store: the first record stays, and a rank
    # that finds a peer gone names that record, not the peer, unless the peer is in it.
    import torch.distributed as dist

    from feedline.distributed import ExchangeTimeout
    from feedline.distributed._exchange import Exchange
    from feedline.distributed._failures import FirstFailure

    store = dist.HashStore()
    ranks = [Exchange(None, r, 5.0, FirstFailure(store, "loader-a")) for r in range(3)]
    with pytest.raises(ExchangeTimeout, match="Rank 2 failed first: rank 2's connection closed"):
        ranks[0]._post(_refused, None, 2, 2, "the send of 1 sample(s) to rank 2", "epoch 0, step 1")
    with pytest.raises(ExchangeTimeout) as caught:
        ranks[1]._post(_refused, None, 0, 4, "the header of 2 sample(s) from rank 0", "e 0, s 2")
    assert (
        "Rank 0 stopped after rank 2 failed first: rank 2's connection closed (epoch 0, step 1, "
        "seen by rank 0)" in str(caught.value)
    )
    # Another loader's record is its own.
    other = Exchange(None, 1, 5.0, FirstFailure(store, "loader-b"))
    with pytest.raises(ExchangeTimeout, match="Rank 0 failed first: rank 0's connection closed"):
        other._post(_refused, None, 0, 4, "the header of 2 sample(s) from rank 0", "e 0, s 2")


def test_a_store_that_cannot_be_reached_leaves_the_first_failure_unknown() -> None:
    from feedline.distributed._failures import FirstFailure

    class Gone:
        def compare_set(self, *_args: object) -> bytes:
            raise RuntimeError("Connection was likely closed. Did the remote server shutdown?")

    assert FirstFailure(Gone(), "k").record(1, "rank 1 raised KeyError") is None
