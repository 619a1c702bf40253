"""Shared-memory connector: one POSIX shm segment per put, zero-copy numpy views on get.

A segment is a file in /dev/shm:

    [0, 64)    header: magic u32, flags u32, generation u64, readers_left i64
    [64, ...)  the payload's arrays, each at a 64-byte aligned offset

named ``omnirt-<conn>-<token>-<rid>-<n>``: ``conn`` is the sanitised connector name,
``token`` is ``<pid>x<random>`` of the connector that created it, ``rid`` the sanitised
request id plus a hash of it, ``n`` a per-connector counter, new for every put. The
handle's locator carries the segment name and the array layout plus the payload's text
and meta, so any process can rebuild the payload from the handle alone, and
``cleanup(request_id)`` in any process finds every segment of a request by listing
/dev/shm.

Lifetime. ``readers`` is the number of gets due. With one reader, the get claims the
segment by unlinking (or renaming, below) its name: a second get of the handle fails.
With several, the header counts the gets still due; each get decrements it under an OFD
lock, so readers in different processes count correctly, and the last one frees the
segment, in whichever process it runs. Mappings stay valid after the unlink. A get of a
consumed or cleaned-up handle raises ``ConnectorError``. ``cleanup`` and ``close`` never
touch segments of connectors with another name, nor ``close`` those of other processes.

Recycling. Writing into fresh tmpfs pages is slow (page allocation and zeroing: 1-2 GB/s
on the dev box, against 8-25 GB/s for memcpy), so the connector that created a segment
reuses it once it is consumed, for segments up to ``pool_bytes``. For those the last get
renames the segment to ``omnirt-<conn>-<token>-free-<id>`` instead of unlinking it (so
``cleanup`` of the finished request leaves it alone), and every reader holds a shared
``flock`` on it for as long as its numpy views live. The creator reuses a free segment
only when it gets the exclusive lock, i.e. when no process maps it any more (a killed
reader's lock goes with it), renames it for the new request and bumps the generation in
its header: a stale handle names a file that no longer exists, and a get that opened the
file just before fails on the rename (one reader) or on the generation (several). Free
segments beyond ``pool_bytes`` are unlinked, ``close()`` unlinks all of them, and free
segments of a dead creator are unlinked by the next connector of that name that starts.
``pool_bytes=0``: no recycling, the last get unlinks.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import itertools
import math
import mmap
import os
import re
import secrets
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_rt.connectors.base import Connector, ConnectorError
from omni_rt.payloads import ALLOWED_DTYPES, Handle, Payload

SHM_DIR = "/dev/shm"
MARKER = "omnirt"
ALIGN = 64
HEADER_SIZE = 64

_HEADER = struct.Struct("<IIQq")  # magic, flags, generation, readers_left
_READERS = struct.Struct("<q")
_READERS_AT = 16
_MAGIC = 0x4F4D5254
_F_RECYCLE = 1
_FREE = "free"
_ZEROS = memoryview(bytes(ALIGN))
_IOV_MAX = 1024
# struct flock on 64-bit Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid.
_FLOCK = struct.Struct("hhqqi4x")
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")
_SEGMENT_RE = re.compile(r"omnirt-[A-Za-z0-9_]+-[0-9]+x[0-9a-f]+-[A-Za-z0-9_]+-[0-9a-f]+")
_PROBE = 8  # free-segment candidates looked at per put
_SWEEP_EVERY = 64  # puts between checks of which tracked segments are free or gone
_MAX_TRACKED = 1024  # recyclable segments per connector (each holds an fd)


def _safe(text: str, limit: int) -> str:
    return _UNSAFE.sub("_", text)[:limit]


@functools.lru_cache(maxsize=4096)
def request_token(request_id: str) -> str:
    """The field of a segment name that identifies its request: readable prefix + hash."""
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{_safe(request_id, 40)}_{digest}"


def _size_class(n: int) -> int:
    """Capacity of a recyclable segment for n bytes: four classes per doubling, whole pages.

    The file stays sparse beyond what was written, so rounding up costs no memory; it
    lets a segment be reused for payloads of similar size."""
    if n <= mmap.PAGESIZE:
        return mmap.PAGESIZE
    step = 1 << max(n.bit_length() - 3, 12)
    return -(-n // step) * step


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _ofd_lock(fd: int, ltype: int) -> None:
    # Open-file-description locks: unlike lockf() they also exclude other threads of this
    # process, and closing some other fd of the file does not drop them.
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(ltype, os.SEEK_SET, 0, HEADER_SIZE, 0))


def _flat_bytes(arr: np.ndarray) -> memoryview:
    flat = arr.reshape(-1) if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(-1)
    return memoryview(flat.view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say otherwise


def _pwritev_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    i = 0
    while i < len(bufs):
        n = os.pwritev(fd, bufs[i : i + _IOV_MAX], offset)
        offset += n
        while i < len(bufs) and n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        if n:
            bufs[i] = bufs[i][n:]


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _exists(path: str) -> bool:
    try:
        os.stat(path)
        return True
    except FileNotFoundError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listdir() -> list[str]:
    try:
        return [e for e in os.listdir(SHM_DIR) if e.startswith(MARKER + "-")]
    except FileNotFoundError:
        return []


def _path(name: str) -> str:
    return f"{SHM_DIR}/{name}"


@dataclass(slots=True, eq=False)
class _Segment:
    """The creator's side of a recyclable segment."""

    fd: int  # our own open file description: its flock(LOCK_EX) claims the segment
    cap: int
    name: str  # name while handed out; `free_name` once consumed
    free_name: str
    gen: int
    hwm: int  # bytes of the file written at least once, i.e. allocated
    mm: mmap.mmap | None = None

    def drop(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view of ours is still alive; unmapped when it dies
                pass
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmConnector(Connector):
    """Shared memory between processes of one host; `get` returns read-only zero-copy views."""

    def __init__(self, name: str = "shm", *, pool_bytes: int = 256 << 20) -> None:
        if pool_bytes < 0:
            raise ValueError("pool_bytes must be >= 0")
        self.name = name
        self.pool_bytes = pool_bytes
        self._conn = _safe(name, 32) or "_"
        self._closed = False
        self.puts = 0
        self.gets = 0
        self.recycled = 0
        self._new_identity()
        self._reap_orphans()

    # -- identity -----------------------------------------------------------------------

    def _new_identity(self) -> None:
        self._pid = os.getpid()
        self._token = f"{self._pid}x{secrets.token_hex(4)}"
        self._prefix = f"{MARKER}-{self._conn}-{self._token}-"
        self._counter = itertools.count()
        self._lock = threading.Lock()
        # capacity -> segment id -> segment, least recently used first. A segment being
        # written is popped from here, so a sweep never drops it under the writer.
        self._pool: dict[int, dict[int, _Segment]] = {}
        self._tracked = 0
        self._puts_since_sweep = 0
        self._pooled_bytes = 0

    def _check_fork(self) -> None:
        # A forked child must neither recycle nor unlink its parent's segments: it takes a
        # token of its own and closes its copies of the parent's fds and mappings (which
        # leaves the parent's locks alone).
        if os.getpid() != self._pid:
            for bucket in self._pool.values():
                for seg in bucket.values():
                    seg.drop()
            self._new_identity()

    # -- put ----------------------------------------------------------------------------

    def put(self, request_id: str, key: str, payload: Payload, readers: int = 1) -> Handle:
        if readers < 1:
            raise ValueError("readers must be >= 1")
        if self._closed:
            raise ConnectorError(f"shm connector {self.name!r} is closed")
        self._check_fork()
        arrays = list(payload.arrays.values())
        layout: list[tuple[str, str, tuple[int, ...], int]] = []
        offset = size = HEADER_SIZE
        for arr_name, arr in payload.arrays.items():
            layout.append((arr_name, arr.dtype.str, tuple(arr.shape), offset))
            size = offset + arr.nbytes
            offset = _align(size)
        cap = _size_class(size)
        rid = request_token(request_id)
        name = f"{self._prefix}{rid}-{next(self._counter):x}"
        recycle = cap <= self.pool_bytes

        seg = self._put_recycled(cap, name, arrays, layout, size, readers) if recycle else None
        if seg is None:
            seg = self._put_fresh(cap, name, arrays, layout, size, readers, recycle)
        with self._lock:
            self.puts += 1
            if seg is not None:
                self._pool.setdefault(cap, {})[id(seg)] = seg
            self._puts_since_sweep += 1
            # A sweep costs two syscalls per tracked segment: keep it under two per put.
            if self._puts_since_sweep >= max(_SWEEP_EVERY, self._tracked):
                self._sweep()
        locator = {
            "segment": name,
            "free": seg.free_name if seg is not None else None,
            "generation": seg.gen if seg is not None else 1,
            "size": size,
            "arrays": layout,
            "text": payload.text,
            "meta": dict(payload.meta),
        }
        return Handle(self.name, request_id, key, payload.kind, payload.fence, payload.nbytes, readers, locator)

    def _put_fresh(
        self,
        cap: int,
        name: str,
        arrays: list[np.ndarray],
        layout: list[tuple[str, str, tuple[int, ...], int]],
        size: int,
        readers: int,
        recycle: bool,
    ) -> _Segment | None:
        with self._lock:
            recycle = recycle and self._tracked < _MAX_TRACKED
            self._tracked += recycle
        path = _path(name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            with self._lock:
                self._tracked -= recycle
            raise ConnectorError(f"cannot create shm segment {path}: {exc}") from exc
        try:
            # A recyclable file is sized to its class but stays sparse beyond `size`.
            # pwrite into fresh tmpfs pages is about twice as fast as faulting them in
            # through a mapping (the written pages are not zeroed first), and a full
            # /dev/shm shows up here as ENOSPC instead of a SIGBUS on a mapped write.
            os.ftruncate(fd, cap if recycle else size)
            header = _HEADER.pack(_MAGIC, _F_RECYCLE if recycle else 0, 1, readers)
            bufs = [memoryview(header), _ZEROS[: HEADER_SIZE - len(header)]]
            end = HEADER_SIZE
            for arr, (_, _, _, off) in zip(arrays, layout, strict=True):
                if arr.nbytes:
                    if off > end:
                        bufs.append(_ZEROS[: off - end])
                    bufs.append(_flat_bytes(arr))
                    end = off + arr.nbytes
            _pwritev_all(fd, bufs, 0)
        except BaseException as exc:
            _unlink(path)
            os.close(fd)
            if recycle:
                with self._lock:
                    self._tracked -= 1
            if isinstance(exc, OSError):
                raise ConnectorError(f"shm put of {size} bytes into {SHM_DIR} failed: {exc}") from exc
            raise
        if not recycle:
            os.close(fd)
            return None
        free_name = f"{self._prefix}{_FREE}-{next(self._counter):x}"
        return _Segment(fd, cap, name, free_name, 1, size)

    def _put_recycled(
        self,
        cap: int,
        name: str,
        arrays: list[np.ndarray],
        layout: list[tuple[str, str, tuple[int, ...], int]],
        size: int,
        readers: int,
    ) -> _Segment | None:
        seg = None
        with self._lock:
            bucket = self._pool.get(cap)
            for key, candidate in list(bucket.items())[:_PROBE] if bucket else ():
                try:
                    # Every reader holds LOCK_SH while its views live, so this succeeds
                    # only once no process maps the segment any more...
                    fcntl.flock(candidate.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                try:
                    # ...and the free name exists only once its last get is done.
                    os.rename(_path(candidate.free_name), _path(name))
                except FileNotFoundError:
                    fcntl.flock(candidate.fd, fcntl.LOCK_UN)
                    continue
                seg = bucket.pop(key)  # type: ignore[union-attr]
                break
        if seg is None:
            return None
        try:
            if size > seg.hwm:
                # Allocate the new part now: a full /dev/shm is then ENOSPC, not a SIGBUS
                # on the mapped write below.
                os.posix_fallocate(seg.fd, seg.hwm, size - seg.hwm)
                seg.hwm = size
            if seg.mm is None:
                # This mapping shares seg.fd's open file description (CPython's mmap
                # keeps a dup of the fd), so LOCK_UN below still releases the claim.
                seg.mm = mmap.mmap(seg.fd, seg.cap)
            for arr, (_, _, _, off) in zip(arrays, layout, strict=True):
                if arr.nbytes:
                    dst = np.frombuffer(seg.mm, np.uint8, arr.nbytes, off).view(arr.dtype).reshape(arr.shape)
                    np.copyto(dst, arr, casting="no")
                    del dst
            seg.gen += 1
            _HEADER.pack_into(seg.mm, 0, _MAGIC, _F_RECYCLE, seg.gen, readers)
        except BaseException as exc:
            _unlink(_path(name))
            seg.drop()
            with self._lock:
                self._tracked -= 1
            if isinstance(exc, OSError):
                raise ConnectorError(f"shm put of {size} bytes into {SHM_DIR} failed: {exc}") from exc
            raise
        fcntl.flock(seg.fd, fcntl.LOCK_UN)
        seg.name = name
        with self._lock:
            self.recycled += 1
        return seg

    # -- get ----------------------------------------------------------------------------

    def get(self, handle: Handle) -> Payload:
        loc = handle.locator
        if handle.connector != self.name or not isinstance(loc, Mapping) or "segment" not in loc:
            raise ConnectorError(
                f"handle {handle.request_id}/{handle.key} does not belong to shm connector {self.name!r}"
            )
        name, free = loc["segment"], loc.get("free")
        if not isinstance(name, str) or not _SEGMENT_RE.fullmatch(name):
            raise ConnectorError(f"handle {handle.request_id}/{handle.key} names no shm segment ({name!r})")
        if free is not None and (
            not isinstance(free, str)
            or not _SEGMENT_RE.fullmatch(free)
            or free.rsplit("-", 2)[0] != name.rsplit("-", 2)[0]
            or free.split("-")[3] != _FREE
        ):
            raise ConnectorError(f"handle {handle.request_id}/{handle.key} has a bad free name ({free!r})")
        gone = f"no payload for {handle.request_id}/{handle.key}: shm segment {name} is gone (consumed or cleaned up)"
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ConnectorError(gone) from None
        try:
            if free is not None:
                # The lease: the creator reuses the segment only once it can lock it
                # exclusively. The mmap below keeps a dup() of this fd (CPython always
                # does), so the lock lives exactly as long as the mapping: until the last
                # numpy view dies, or this process does.
                fcntl.flock(fd, fcntl.LOCK_SH)
            if handle.readers == 1:
                # Taking the name away is the claim: of two gets of one handle, one wins.
                self._release(path, free, gone, strict=True)
            else:
                _ofd_lock(fd, fcntl.F_WRLCK)
                try:
                    magic, _, gen, left = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
                    if magic != _MAGIC or gen != loc.get("generation") or left <= 0:
                        raise ConnectorError(gone)
                    os.pwrite(fd, _READERS.pack(left - 1), _READERS_AT)
                    if left == 1:
                        self._release(path, free, gone, strict=False)
                finally:
                    _ofd_lock(fd, fcntl.F_UNLCK)

            arrays: dict[str, np.ndarray] = {}
            mm = None
            for arr_name, dtype, shape, off in loc["arrays"]:
                if dtype not in ALLOWED_DTYPES:
                    raise ConnectorError(f"shm segment {name}: array {arr_name!r} has dtype {dtype!r}")
                dt = np.dtype(dtype)
                count = math.prod(shape)
                if count == 0:
                    arr = np.empty(shape, dt)
                    arr.flags.writeable = False
                else:
                    if mm is None:
                        # Mapped by hand, not with multiprocessing.shared_memory: on Python
                        # 3.11 attaching a SharedMemory registers the segment with this
                        # process's resource_tracker, which unlinks it (with a warning)
                        # when this process exits, though the creator owns it; and
                        # SharedMemory.close() raises BufferError while numpy views exist.
                        # numpy keeps this read-only mmap alive and it is unmapped when
                        # the last view dies.
                        mm = mmap.mmap(fd, loc["size"], access=mmap.ACCESS_READ)
                    arr = np.frombuffer(mm, dt, count, off).reshape(shape)
                arrays[arr_name] = arr
        finally:
            os.close(fd)
        with self._lock:
            self.gets += 1
        return Payload(handle.kind, handle.fence, arrays, loc.get("text"), dict(loc.get("meta") or {}))

    @staticmethod
    def _release(path: str, free: str | None, gone: str, *, strict: bool) -> None:
        """Take a consumed segment's name away: back to its creator's pool, or unlinked."""
        try:
            if free is not None:
                os.rename(path, _path(free))
            else:
                os.unlink(path)
        except FileNotFoundError:
            if strict:  # another get or a cleanup took it first
                raise ConnectorError(gone) from None

    # -- cleanup / health / close -------------------------------------------------------

    def cleanup(self, request_id: str) -> int:
        """Unlink every segment of `request_id` made by a connector of this name, in any process."""
        self._check_fork()
        token = request_token(request_id)
        freed = 0
        for entry in _listdir():
            parts = entry.split("-")
            if len(parts) == 5 and parts[1] == self._conn and parts[3] == token:
                freed += _unlink(_path(entry))
        with self._lock:  # let go of our own segments of the request at once
            for bucket in self._pool.values():
                for key, seg in list(bucket.items()):
                    if seg.name.split("-")[3] == token and os.fstat(seg.fd).st_nlink == 0:
                        del bucket[key]
                        seg.drop()
                        self._tracked -= 1
        return freed

    def _sweep(self) -> None:
        """Drop tracked segments whose file is gone; trim free ones beyond the budget. Lock held."""
        self._puts_since_sweep = 0
        free: list[_Segment] = []
        for bucket in self._pool.values():
            for key, seg in list(bucket.items()):
                if os.fstat(seg.fd).st_nlink == 0:  # cleaned up, or trimmed
                    del bucket[key]
                    seg.drop()
                    self._tracked -= 1
                elif _exists(_path(seg.free_name)):
                    free.append(seg)
        pooled = sum(seg.cap for seg in free)
        for seg in free:  # least recently used first, per class
            if pooled <= self.pool_bytes:
                break
            _unlink(_path(seg.free_name))
            del self._pool[seg.cap][id(seg)]
            seg.drop()
            self._tracked -= 1
            pooled -= seg.cap
        self._pooled_bytes = pooled

    def _reap_orphans(self) -> None:
        # Free segments have no get pending, so unlinking one is always safe (mappings
        # stay valid); only those of dead creators are taken, to leave live pools alone.
        for entry in _listdir():
            parts = entry.split("-")
            if len(parts) == 5 and parts[1] == self._conn and parts[3] == _FREE:
                pid = parts[2].split("x", 1)[0]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    _unlink(_path(entry))

    def live_segments(self) -> int:
        """Segments this connector created that still wait for a get."""
        return sum(1 for e in _listdir() if e.startswith(self._prefix) and e.split("-")[3] != _FREE)

    def health(self) -> dict[str, Any]:
        self._check_fork()
        with self._lock:
            self._sweep()
            tracked = self._tracked
        try:
            st = os.statvfs(SHM_DIR)
            free_bytes, total_bytes = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        except OSError:
            free_bytes = total_bytes = 0
        return {
            "ok": not self._closed and free_bytes > 0,
            "backend": "shm",
            "name": self.name,
            "live_segments": self.live_segments(),
            "recyclable_segments": tracked,
            "pooled_bytes": self._pooled_bytes,
            "shm_free_bytes": free_bytes,
            "shm_total_bytes": total_bytes,
            "puts": self.puts,
            "gets": self.gets,
            "recycled": self.recycled,
        }

    def close(self) -> None:
        """Unlink every segment this connector created, handed out or pooled."""
        self._check_fork()
        self._closed = True
        with self._lock:
            for bucket in self._pool.values():
                for seg in bucket.values():
                    seg.drop()
            self._pool.clear()
            self._tracked = 0
            self._pooled_bytes = 0
        for entry in _listdir():
            if entry.startswith(self._prefix):
                _unlink(_path(entry))
