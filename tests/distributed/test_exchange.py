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


def test_a_send_or_receive_that_a_dead_peer_refuses_raises_exchange_timeout() -> None:
    # gloo refuses to start a transfer on a connection the peer closed, before any wait;
    # that must read like a broken wait: which rank, what, which step, and what to look at.
    from feedline.distributed import ExchangeTimeout
    from feedline.distributed._exchange import Exchange

    def refused(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(
            "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242\n"
            "more lines of gloo's own"
        )

    exchange = Exchange(group=None, rank=0, timeout=5.0)
    with pytest.raises(ExchangeTimeout) as caught:
        exchange._post(refused, None, 2, 14, "the send of 3 sample(s) to rank 2", "epoch 1, step 7")
    message = str(caught.value)
    assert "rank 0: the send of 3 sample(s) to rank 2 failed (epoch 1, step 7)" in message
    assert "Connection closed by peer" in message
    assert "probably died" in message
    assert "more lines" not in message
