"""Connectors: inproc (same object, zero copy); the ray connector is tested with the
placed stages (tests/test_placement.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omni_rt.connectors import ConnectorError, InprocConnector, make_connector
from omni_rt.payloads import Fence, Payload, PayloadError, PayloadKind

FENCE = Fence("sess-1", epoch=2, turn=5)
TIMEOUT = 60


def _payload(**arrays: np.ndarray) -> Payload:
    return Payload(PayloadKind.HIDDEN, FENCE, dict(arrays))


# ---------------------------------------------------------------------------------------
# inproc


def test_inproc_get_returns_the_same_object_zero_copy() -> None:
    conn = InprocConnector()
    x = np.arange(1000, dtype=np.float32)
    payload = _payload(x=x)
    handle = conn.put("r1", "hidden", payload)
    assert handle.connector == "inproc" and handle.nbytes == 4000 and handle.fence == FENCE
    got = conn.get(handle)
    assert got is payload
    assert np.shares_memory(got.arrays["x"], x)


def test_inproc_readers_are_counted_and_consumed_get_raises() -> None:
    conn = InprocConnector()
    handle = conn.put("r1", "k", _payload(x=np.ones(3)), readers=2)
    assert conn.get(handle).arrays["x"].sum() == 3
    assert conn.live_keys() == 1
    conn.get(handle)
    assert conn.live_keys() == 0
    with pytest.raises(ConnectorError, match="consumed"):
        conn.get(handle)
    with pytest.raises(ValueError):
        conn.put("r1", "k2", _payload(), readers=0)


def test_inproc_duplicate_key_is_refused() -> None:
    conn = InprocConnector()
    conn.put("r1", "k", _payload())
    with pytest.raises(ConnectorError, match="already stored"):
        conn.put("r1", "k", _payload())


def test_inproc_cleanup_frees_and_counts() -> None:
    conn = InprocConnector()
    handles = [conn.put("r1", f"k{i}", _payload(x=np.zeros(2))) for i in range(3)]
    other = conn.put("r2", "k0", _payload(x=np.ones(2)))
    assert conn.cleanup("r1") == 3
    assert conn.cleanup("r1") == 0
    for handle in handles:
        with pytest.raises(ConnectorError):
            conn.get(handle)
    assert conn.get(other).arrays["x"].tolist() == [1.0, 1.0]
    assert conn.health() == {"ok": True, "backend": "inproc", "live_keys": 0, "requests": 0}


@pytest.mark.parametrize(
    "bad",
    [np.array([{"a": 1}], dtype=object), np.zeros(2, dtype=np.complex64), np.zeros(2, dtype="V4"), [1, 2]],
    ids=["object", "complex", "void", "list"],
)
def test_payload_refuses_arrays_that_cannot_cross(bad: Any) -> None:
    with pytest.raises(PayloadError):
        _payload(x=bad)


def test_make_connector_knows_its_backends() -> None:
    assert isinstance(make_connector("inproc"), InprocConnector)
    for gone in ("shm", "carrier-pigeon"):
        with pytest.raises(ValueError, match="known: inproc, ray"):
            make_connector(gone)
