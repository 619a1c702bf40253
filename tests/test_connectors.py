"""Connectors: inproc (same object, zero copy) and shm (shared memory across processes).

The shm tests look at /dev/shm itself to check that nothing is left behind. Every test
uses its own connector name and request ids, so engineers running other suites at the
same time do not disturb them.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import threading
import uuid
from typing import Any

import numpy as np
import pytest

from omni_rt.connectors import ConnectorError, InprocConnector, make_connector
from omni_rt.connectors.shm import SHM_DIR, ShmConnector
from omni_rt.payloads import Fence, Handle, Payload, PayloadError, PayloadKind

FENCE = Fence("sess-1", epoch=2, turn=5)
TIMEOUT = 60


def _payload(**arrays: np.ndarray) -> Payload:
    return Payload(PayloadKind.HIDDEN, FENCE, dict(arrays))


def _rid() -> str:
    return f"req-{uuid.uuid4().hex}"


def _entries(needle: str) -> list[str]:
    """/dev/shm entries whose name contains needle."""
    return [e for e in os.listdir(SHM_DIR) if needle in e]


def _rid_entries(rid: str) -> list[str]:
    # Segment names carry the request id with unsafe characters replaced by "_".
    return _entries(rid.replace("-", "_"))


def _conn_entries(conn_name: str) -> list[str]:
    return [e for e in os.listdir(SHM_DIR) if e.startswith(f"omnirt-{conn_name}-")]


def _mapped_base(arr: np.ndarray) -> Any:
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


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


def test_make_connector_knows_both_backends() -> None:
    assert isinstance(make_connector("inproc"), InprocConnector)
    conn = make_connector("shm", f"t{uuid.uuid4().hex[:8]}")
    try:
        assert isinstance(conn, ShmConnector) and conn.health()["backend"] == "shm"
    finally:
        conn.close()
    with pytest.raises(ValueError):
        make_connector("carrier-pigeon")


# ---------------------------------------------------------------------------------------
# shm, one process


@pytest.fixture(params=[256 << 20, 0], ids=["pooled", "unpooled"])
def shm(request: pytest.FixtureRequest) -> Any:
    conn = ShmConnector(f"t{uuid.uuid4().hex[:8]}", pool_bytes=request.param)
    yield conn
    conn.close()
    assert _conn_entries(conn.name) == []


def _mixed_payload() -> Payload:
    rng = np.random.default_rng(7)
    return Payload(
        PayloadKind.CODES,
        FENCE,
        {
            "hidden": rng.standard_normal((3, 17), dtype=np.float32),
            "codes": np.arange(40, dtype=np.int64).reshape(8, 5)[:, ::2],  # not contiguous
            "fortran": np.asfortranarray(rng.standard_normal((4, 3, 2)).astype(np.float16)),
            "flag": np.array(True),  # 0-d
            "empty": np.zeros((0, 3), dtype=np.uint8),
            "pcm": (rng.standard_normal(1001) * 1000).astype(np.int16),
            "u32": np.array([0, 1, 2**32 - 1], dtype=np.uint32),
        },
        text="héllo wörld ✓",
        meta={"sample_rate": 24000, "frames": [0, 12], "final": False, "codec": {"name": "mimi", "q": 8}},
    )


def test_shm_round_trip_of_arrays_text_and_meta(shm: ShmConnector) -> None:
    payload = _mixed_payload()
    handle = shm.put("r-1", "codes", payload)
    assert isinstance(handle, Handle) and handle.connector == shm.name
    assert handle.nbytes == payload.nbytes and handle.kind is PayloadKind.CODES and handle.fence == FENCE
    got = shm.get(handle)
    assert got.kind is PayloadKind.CODES and got.fence == FENCE
    assert got.text == "héllo wörld ✓"
    assert got.meta == {"sample_rate": 24000, "frames": [0, 12], "final": False, "codec": {"name": "mimi", "q": 8}}
    assert set(got.arrays) == set(payload.arrays)
    for name, want in payload.arrays.items():
        have = got.arrays[name]
        assert have.dtype == want.dtype, name
        assert have.shape == want.shape, name
        np.testing.assert_array_equal(have, want)
    assert got.arrays["flag"].ndim == 0 and bool(got.arrays["flag"]) is True
    assert got.arrays["u32"][-1] == 2**32 - 1


def test_shm_views_are_read_only_and_zero_copy(shm: ShmConnector) -> None:
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    got = shm.get(shm.put("r-1", "k", _payload(x=x, y=np.ones(10, np.int32))))
    for arr in got.arrays.values():
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 0
        with pytest.raises(ValueError):
            arr.flags.writeable = True
        assert isinstance(_mapped_base(arr), mmap.mmap)  # a view of the segment, not a copy
    assert not np.shares_memory(got.arrays["x"], x)
    assert got.arrays["x"][63, 63] == 4095.0
    # arrays live at aligned offsets of one mapping
    assert _mapped_base(got.arrays["x"]) is _mapped_base(got.arrays["y"])
    assert got.arrays["y"].ctypes.data % 64 == 0 and got.arrays["x"].ctypes.data % 64 == 0


def test_shm_text_only_payload(shm: ShmConnector) -> None:
    handle = shm.put("r-1", "text", Payload(PayloadKind.TEXT, FENCE, text="just words", meta={"lang": "en"}))
    got = shm.get(handle)
    assert (got.text, got.meta, got.arrays) == ("just words", {"lang": "en"}, {})
    with pytest.raises(ConnectorError):
        shm.get(handle)


def test_shm_one_reader_get_leaves_no_segment_of_the_request(shm: ShmConnector) -> None:
    rid = _rid()
    handle = shm.put(rid, "k", _payload(x=np.arange(100, dtype=np.float64)))
    assert len(_rid_entries(rid)) == 1
    assert shm.health()["live_segments"] == 1
    got = shm.get(handle)
    assert _rid_entries(rid) == []
    assert shm.health()["live_segments"] == 0
    if shm.pool_bytes == 0:
        assert _conn_entries(shm.name) == []
    else:  # back in the creator's pool, outside the request's namespace
        assert [e.split("-")[3] for e in _conn_entries(shm.name)] == ["free"]
    assert got.arrays["x"].sum() == 4950.0  # the mapping outlives the name
    with pytest.raises(ConnectorError, match="gone"):
        shm.get(handle)
    assert shm.cleanup(rid) == 0


def test_shm_two_readers_keep_the_segment_until_the_second_get(shm: ShmConnector) -> None:
    rid = _rid()
    handle = shm.put(rid, "k", _payload(x=np.full(10, 7, np.int32)), readers=2)
    first = shm.get(handle)
    assert len(_rid_entries(rid)) == 1
    second = shm.get(handle)
    assert _rid_entries(rid) == []
    assert first.arrays["x"].tolist() == second.arrays["x"].tolist() == [7] * 10
    with pytest.raises(ConnectorError):
        shm.get(handle)


def test_shm_two_readers_one_get_then_cleanup(shm: ShmConnector) -> None:
    rid = _rid()
    handle = shm.put(rid, "k", _payload(x=np.full(10, 3, np.int32)), readers=2)
    got = shm.get(handle)
    assert shm.cleanup(rid) == 1
    assert _rid_entries(rid) == []
    with pytest.raises(ConnectorError, match="gone"):
        shm.get(handle)
    assert got.arrays["x"].sum() == 30


def test_shm_cleanup_unlinks_every_segment_of_a_request_only(shm: ShmConnector) -> None:
    rid, other = _rid(), _rid()
    handles = [shm.put(rid, f"chunk{i}", _payload(x=np.full(1000 * (i + 1), i, np.float32))) for i in range(4)]
    kept = shm.put(other, "chunk0", _payload(x=np.ones(5, np.float32)))
    consumed = shm.get(handles[0])
    assert len(_rid_entries(rid)) == 3
    assert shm.cleanup(rid) == 3
    assert shm.cleanup(rid) == 0
    assert _rid_entries(rid) == []
    for handle in handles:
        with pytest.raises(ConnectorError):
            shm.get(handle)
    assert consumed.arrays["x"].sum() == 0.0
    assert shm.get(kept).arrays["x"].sum() == 5.0


def test_shm_cleanup_from_another_connector_instance(shm: ShmConnector) -> None:
    rid = _rid()
    for i in range(3):
        shm.put(rid, f"k{i}", _payload(x=np.zeros(64)))
    other = ShmConnector(shm.name)  # e.g. the orchestrator's instance
    try:
        assert other.cleanup(rid) == 3
    finally:
        other.close()
    assert _rid_entries(rid) == []


def test_shm_any_request_id_is_safe(shm: ShmConnector) -> None:
    for rid in ["a/b c", "../../etc/passwd", "ü-ñ-語", "*?[x]", "", "x" * 500, "free", "a-b-c-d-e"]:
        handle = shm.put(rid, "k", _payload(x=np.arange(3)), readers=2)
        name = handle.locator["segment"]
        assert "/" not in name and len(name) < 200 and os.path.exists(f"{SHM_DIR}/{name}")
        assert shm.get(handle).arrays["x"].tolist() == [0, 1, 2]
        assert shm.cleanup(rid) == 1
        assert not os.path.exists(f"{SHM_DIR}/{name}")
    assert shm.live_segments() == 0


def test_shm_similar_request_ids_do_not_collide(shm: ShmConnector) -> None:
    # "a/b" and "a_b" sanitise alike; the hash in the name keeps them apart
    shm.put("a/b", "k", _payload(x=np.zeros(1)))
    shm.put("a_b", "k", _payload(x=np.zeros(1)))
    assert shm.cleanup("a/b") == 1
    assert shm.cleanup("a_b") == 1


def test_shm_close_leaves_nothing_behind(shm: ShmConnector) -> None:
    rid = _rid()
    pending = shm.put(rid, "pending", _payload(x=np.zeros(1 << 16)))
    shm.put(rid, "pending2", _payload(x=np.zeros(10)), readers=3)
    held = shm.get(shm.put(rid, "consumed", _payload(x=np.ones(1 << 12))))
    assert len(_conn_entries(shm.name)) >= 2
    shm.close()
    assert _conn_entries(shm.name) == []
    assert held.arrays["x"].sum() == 1 << 12
    with pytest.raises(ConnectorError, match="gone"):
        shm.get(pending)
    with pytest.raises(ConnectorError, match="closed"):
        shm.put(rid, "late", _payload())


def test_shm_refuses_foreign_and_bad_handles(shm: ShmConnector) -> None:
    inproc = InprocConnector()
    with pytest.raises(ConnectorError):
        shm.get(inproc.put("r", "k", _payload()))
    handle = shm.put("r", "k", _payload(x=np.zeros(2)))
    with pytest.raises(ConnectorError, match="does not belong"):
        shm.get(Handle("other", "r", "k", handle.kind, FENCE, 0, 1, handle.locator))
    bad = dict(handle.locator or {}, segment="../../tmp/x")
    with pytest.raises(ConnectorError, match="names no shm segment"):
        shm.get(Handle(shm.name, "r", "k", handle.kind, FENCE, 0, 1, bad))
    with pytest.raises(ValueError):
        shm.put("r", "k", _payload(), readers=0)
    assert shm.get(handle).arrays["x"].tolist() == [0.0, 0.0]


def test_shm_health(shm: ShmConnector) -> None:
    shm.put("r", "a", _payload(x=np.zeros(10)))
    shm.put("r", "b", _payload(x=np.zeros(10)))
    health = shm.health()
    assert health["ok"] is True and health["backend"] == "shm" and health["name"] == shm.name
    assert health["live_segments"] == 2
    assert health["shm_free_bytes"] > 0 and health["shm_total_bytes"] >= health["shm_free_bytes"]
    assert health["puts"] == 2 and health["gets"] == 0
    shm.close()
    assert shm.health()["ok"] is False and shm.health()["live_segments"] == 0


@pytest.mark.parametrize("readers", [1, 3])
def test_shm_concurrent_gets_of_one_handle_honour_readers(shm: ShmConnector, readers: int) -> None:
    handle = shm.put(_rid(), "k", _payload(x=np.arange(50)), readers=readers)
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def grab() -> None:
        barrier.wait()
        try:
            results.append(int(shm.get(handle).arrays["x"].sum()))
        except ConnectorError:
            results.append(None)

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(r for r in results if r is not None) == [1225] * readers
    assert results.count(None) == 8 - readers
    assert shm.live_segments() == 0


def test_shm_threads_put_and_get_concurrently(shm: ShmConnector) -> None:
    errors: list[Any] = []

    def worker(i: int) -> None:
        rid = _rid()
        try:
            for j in range(60):
                x = np.full(500 + 37 * j, i * 1000 + j, np.int64)
                got = shm.get(shm.put(rid, f"k{j}", _payload(x=x)))
                if not np.array_equal(got.arrays["x"], x):
                    errors.append((i, j))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert errors == []
    assert shm.live_segments() == 0
    if shm.pool_bytes:
        assert shm.recycled > 0


def test_shm_forked_child_leaves_the_parents_segments_alone(shm: ShmConnector) -> None:
    handle = shm.put(_rid(), "k", _payload(x=np.arange(5)))
    child = mp.get_context("fork").Process(target=shm.close)  # inherits this connector
    child.start()
    child.join(TIMEOUT)
    assert child.exitcode == 0
    assert shm.get(handle).arrays["x"].tolist() == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------------------
# shm recycling (pooled)


@pytest.fixture
def pooled() -> Any:
    conn = ShmConnector(f"t{uuid.uuid4().hex[:8]}", pool_bytes=1 << 20)
    yield conn
    conn.close()
    assert _conn_entries(conn.name) == []


def test_recycling_reuses_a_consumed_segment(pooled: ShmConnector) -> None:
    got = pooled.get(pooled.put(_rid(), "k", _payload(x=np.full(1000, 1.0))))
    del got
    rid = _rid()
    got = pooled.get(pooled.put(rid, "k", _payload(x=np.full(1000, 2.0), y=np.arange(5))))
    assert pooled.recycled == 1
    assert got.arrays["x"].sum() == 2000.0 and got.arrays["y"].tolist() == [0, 1, 2, 3, 4]
    assert _rid_entries(rid) == []


def test_recycling_never_overwrites_live_views(pooled: ShmConnector) -> None:
    first = pooled.get(pooled.put(_rid(), "k", _payload(x=np.full(1000, 1.0))))
    second = pooled.get(pooled.put(_rid(), "k", _payload(x=np.full(1000, 2.0))))
    assert pooled.recycled == 0  # first's views still map its segment
    assert first.arrays["x"].sum() == 1000.0 and second.arrays["x"].sum() == 2000.0
    view = first.arrays["x"][10:20]  # a view of a view keeps the segment leased too
    del first
    third = pooled.get(pooled.put(_rid(), "k", _payload(x=np.full(1000, 3.0))))
    assert pooled.recycled == 0
    assert view.tolist() == [1.0] * 10
    del view
    fourth = pooled.get(pooled.put(_rid(), "k", _payload(x=np.full(1000, 4.0))))
    assert pooled.recycled == 1
    assert second.arrays["x"].sum() == 2000.0
    assert third.arrays["x"].sum() == 3000.0
    assert fourth.arrays["x"].sum() == 4000.0


@pytest.mark.parametrize("readers", [1, 2])
def test_recycling_makes_stale_handles_fail(pooled: ShmConnector, readers: int) -> None:
    rid = _rid()
    stale = pooled.put(rid, "k", _payload(x=np.full(100, 1, np.int64)), readers=readers)
    for _ in range(readers):
        pooled.get(stale)
    fresh = pooled.put(rid, "k", _payload(x=np.full(100, 2, np.int64)), readers=readers)
    assert pooled.recycled == 1
    with pytest.raises(ConnectorError):
        pooled.get(stale)
    assert pooled.get(fresh).arrays["x"].sum() == 200


def test_recycling_after_cleanup_of_a_finished_request(pooled: ShmConnector) -> None:
    rid = _rid()
    pooled.get(pooled.put(rid, "k", _payload(x=np.zeros(1000))))
    assert pooled.cleanup(rid) == 0  # consumed: in the pool, not the request's any more
    pooled.get(pooled.put(_rid(), "k", _payload(x=np.zeros(1000))))
    assert pooled.recycled == 1


def test_recycling_grows_a_segment_within_its_class(pooled: ShmConnector) -> None:
    pooled.get(pooled.put(_rid(), "k", _payload(x=np.zeros(4500, np.uint8))))
    got = pooled.get(pooled.put(_rid(), "k", _payload(x=np.full(6000, 9, np.uint8))))
    assert pooled.recycled == 1  # 4.5k and 6k share the 8 KiB class
    assert got.arrays["x"].sum() == 54000


def test_pool_stays_within_its_budget(pooled: ShmConnector) -> None:
    handles = [pooled.put(_rid(), "k", _payload(x=np.zeros(60_000, np.uint8))) for _ in range(40)]
    for handle in handles:
        pooled.get(handle)
    health = pooled.health()
    assert health["live_segments"] == 0
    assert 0 < health["pooled_bytes"] <= pooled.pool_bytes
    assert 0 < len(_conn_entries(pooled.name)) <= pooled.pool_bytes // 60_000


def test_large_payloads_are_not_pooled(pooled: ShmConnector) -> None:
    rid = _rid()
    pooled.get(pooled.put(rid, "k", _payload(x=np.zeros(2 << 20, np.uint8))))
    assert _conn_entries(pooled.name) == []  # above pool_bytes: unlinked by its get
