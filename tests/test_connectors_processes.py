"""The shm connector across processes (spawn: a fresh interpreter, as the stage
processes use): a child puts and the parent gets and back, and nothing leaks when a
reader or a writer is killed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import uuid
from typing import Any

import numpy as np
import pytest

from omni_rt.connectors import ConnectorError
from omni_rt.connectors.shm import ShmConnector
from omni_rt.payloads import Handle, Payload, PayloadKind
from tests.test_connectors import FENCE, TIMEOUT, _conn_entries, _payload, _rid, _rid_entries

pytestmark = pytest.mark.integration  # processes of their own (spawned, killed)


def _child_put(conn_name: str, pool_bytes: int, rid: str, out: Any, done: Any) -> None:
    conn = ShmConnector(conn_name, pool_bytes=pool_bytes)
    x = np.arange(12, dtype=np.float32).reshape(3, 4) * 1.5
    payload = Payload(PayloadKind.AUDIO, FENCE, {"pcm": x, "idx": np.array([5, 6], np.int16)}, "child", {"sr": 16000})
    out.put(conn.put(rid, "pcm", payload))
    done.wait(TIMEOUT)
    conn.close()


def _child_get(conn_name: str, handles: Any, out: Any, hold: Any) -> None:
    conn = ShmConnector(conn_name)
    while True:
        handle = handles.get(timeout=TIMEOUT)
        if handle is None:
            break
        try:
            got = conn.get(handle)
        except ConnectorError as exc:
            out.put(("error", str(exc)))
            continue
        arrays = {k: (v.tolist(), v.dtype.str, v.flags.writeable) for k, v in got.arrays.items()}
        out.put(("ok", arrays, got.text, got.meta))
        if hold is not None:  # keep the views alive until killed
            hold.set()
            signal.pause()


def _child_put_and_die(conn_name: str, rid: str, out: Any) -> None:
    conn = ShmConnector(conn_name)
    for i in range(3):
        out.put(conn.put(rid, f"k{i}", _payload(x=np.full(256, i, np.int32))))
    out.close()
    out.join_thread()  # the handles are sent; no close(), no exit handlers
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def ctx() -> Any:
    return mp.get_context("spawn")


@pytest.mark.parametrize("pool_bytes", [256 << 20, 0], ids=["pooled", "unpooled"])
def test_child_puts_parent_gets(ctx: Any, pool_bytes: int) -> None:
    name, rid = f"t{uuid.uuid4().hex[:8]}", _rid()
    out, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_child_put, args=(name, pool_bytes, rid, out, done))
    child.start()
    conn = ShmConnector(name, pool_bytes=pool_bytes)
    try:
        handle = out.get(timeout=TIMEOUT)
        assert isinstance(handle, Handle) and handle.request_id == rid and handle.kind is PayloadKind.AUDIO
        got = conn.get(handle)
        np.testing.assert_array_equal(got.arrays["pcm"], np.arange(12, dtype=np.float32).reshape(3, 4) * 1.5)
        assert got.arrays["idx"].dtype == np.int16 and got.arrays["idx"].tolist() == [5, 6]
        assert (got.text, got.meta, got.fence) == ("child", {"sr": 16000}, FENCE)
        assert not got.arrays["pcm"].flags.writeable
        assert _rid_entries(rid) == []
        with pytest.raises(ConnectorError):
            conn.get(handle)
    finally:
        done.set()
        child.join(TIMEOUT)
        conn.close()
    assert child.exitcode == 0
    assert got.arrays["pcm"][2, 3] == 16.5  # the child closed its connector; our mapping holds
    assert _conn_entries(name) == []


def test_parent_puts_child_gets(ctx: Any) -> None:
    name, rid = f"t{uuid.uuid4().hex[:8]}", _rid()
    conn = ShmConnector(name)
    handles, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_get, args=(name, handles, out, None))
    child.start()
    try:
        x = np.linspace(-1, 1, 480, dtype=np.float32)
        one = conn.put(rid, "one", Payload(PayloadKind.AUDIO, FENCE, {"pcm": x}, None, {"sr": 24000}))
        two = conn.put(rid, "two", _payload(h=np.eye(3, dtype=np.float64)), readers=2)
        handles.put(one)
        status, arrays, text, meta = out.get(timeout=TIMEOUT)
        assert status == "ok" and meta == {"sr": 24000} and text is None
        assert arrays["pcm"][1] == "<f4" and arrays["pcm"][2] is False
        np.testing.assert_array_equal(np.array(arrays["pcm"][0], np.float32), x)
        handles.put(one)  # consumed by the child
        status, message = out.get(timeout=TIMEOUT)
        assert status == "error" and "gone" in message
        # readers=2: one get in the child, the last one here frees the segment
        handles.put(two)
        status, arrays, _, _ = out.get(timeout=TIMEOUT)
        assert status == "ok" and arrays["h"][0] == np.eye(3).tolist()
        assert len(_rid_entries(rid)) == 1
        assert conn.get(two).arrays["h"].trace() == 3.0
        assert _rid_entries(rid) == []
    finally:
        handles.put(None)
        child.join(TIMEOUT)
        conn.close()
    assert child.exitcode == 0
    assert _conn_entries(name) == []


def test_killed_reader_leaks_nothing(ctx: Any) -> None:
    name, rid = f"t{uuid.uuid4().hex[:8]}", _rid()
    conn = ShmConnector(name)
    handles, out, hold = ctx.Queue(), ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_child_get, args=(name, handles, out, hold))
    child.start()
    try:
        pending = conn.put(rid, "pending", _payload(x=np.zeros(1000)), readers=2)
        handles.put(pending)
        assert out.get(timeout=TIMEOUT)[0] == "ok"
        assert hold.wait(TIMEOUT)
        # the child maps the segment: it is not recycled under it
        conn.get(pending)
        conn.get(conn.put(_rid(), "k", _payload(x=np.ones(1000))))
        assert conn.recycled == 0
        os.kill(child.pid, signal.SIGKILL)
        child.join(TIMEOUT)
        assert child.exitcode == -signal.SIGKILL
        # its lease died with it
        got = conn.get(conn.put(_rid(), "k", _payload(x=np.full(1000, 5.0))))
        assert conn.recycled == 1 and got.arrays["x"].sum() == 5000.0
        # and a request it was reading is cleaned up as usual
        orphan = conn.put(rid, "orphan", _payload(x=np.zeros(1000)), readers=2)
        assert conn.cleanup(rid) == 1
        assert _rid_entries(rid) == []
        with pytest.raises(ConnectorError):
            conn.get(orphan)
    finally:
        if child.is_alive():
            child.kill()
        conn.close()
    assert _conn_entries(name) == []


def test_killed_writer_leaks_nothing(ctx: Any) -> None:
    name, rid = f"t{uuid.uuid4().hex[:8]}", _rid()
    out = ctx.Queue()
    child = ctx.Process(target=_child_put_and_die, args=(name, rid, out))
    child.start()
    conn = ShmConnector(name)
    try:
        handles = [out.get(timeout=TIMEOUT) for _ in range(3)]
        child.join(TIMEOUT)
        assert child.exitcode == -signal.SIGKILL
        assert len(_rid_entries(rid)) == 3
        # a get after the writer died still works; its free segment is left for reaping
        assert conn.get(handles[0]).arrays["x"].tolist() == [0] * 256
        assert conn.cleanup(rid) == 2
        assert _rid_entries(rid) == []
        assert [e.split("-")[3] for e in _conn_entries(name)] == ["free"]
        ShmConnector(name).close()  # a new connector reaps free segments of dead creators
        assert _conn_entries(name) == []
    finally:
        conn.cleanup(rid)
        conn.close()
        ShmConnector(name).close()
