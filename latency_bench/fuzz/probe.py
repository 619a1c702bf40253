"""Sending mutants and classifying what the server did: HTTP status and error shape, the
probe after every WebSocket message, OpenPI's text-then-close."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from latency_bench.fuzz.mutate import EXAMPLES_PER_KIND, Mutant, _bytes_mutation, _structural, dumps, mutate_json
from latency_bench.fuzz.seeds import BAD_FORM_TYPES, OFFER_SDP, VIDEO, mutate_form, mutate_openpi, mutate_sdp, openpi_seeds, realtime_seeds

# ---- running and classifying ----------------------------------------------------------------


TAP: LogTap | None = None  # set by run_fuzz while it runs
HTTP_TIMEOUT_FACTOR = 6  # an HTTP answer may be a whole generation


class LogTap(logging.Handler):
    """In-process runs: the server's logged exceptions (where each one was raised), so a
    failure can say what broke inside the server."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if not record.exc_info or record.exc_info[1] is None:
            return
        sig = exception_signature(record.exc_info[1])
        self.records.append(sig)
        self.counts[sig] += 1


def exception_signature(exc: BaseException) -> str:
    """`Type: message at file:line (via the deepest frame of this project)`."""
    tb = exc.__traceback__
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = [f for f in frames if f[0].startswith(root) and "site-packages" not in f[0]]
    where = ""
    if frames:
        f = frames[-1]
        where = f" at {os.path.relpath(f[0], root) if f in ours else os.path.basename(f[0])}:{f[1]} in {f[2]}"
    if ours and ours[-1] != frames[-1]:
        where += f" (via {os.path.relpath(ours[-1][0], root)}:{ours[-1][1]} in {ours[-1][2]})"
    msg = re.sub(r"\d{6,}", "<n>", str(exc))[:90]
    return f"{type(exc).__name__}: {msg}{where}"


@dataclass
class Tally:
    name: str
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    seeds: list[str] = field(default_factory=list)  # what each unmutated seed got (the fuzzer's coverage check)
    causes: Counter[str] = field(default_factory=Counter)  # in-process: failure kind <- the first exception the server logged for it
    seconds: float = 0.0
    tap: LogTap | None = None
    _mark: int = 0

    def __post_init__(self) -> None:
        self.tap = TAP

    def mark(self) -> None:
        self._mark = len(self.tap.records) if self.tap is not None else 0

    def seed_outcome(self, m: Mutant | None, kind: str) -> None:
        if m is not None and m.how == "seed (unmutated)":
            self.seeds.append(f"{m.short()[:90]} -> {kind}")

    def ok(self, kind: str, m: Mutant | None = None) -> None:
        self.outcomes[kind] += 1
        self.seed_outcome(m, kind)

    def fail(self, kind: str, m: Mutant | None, what: str) -> None:
        self.outcomes["FAIL " + kind] += 1
        self.seed_outcome(m, "FAIL " + kind)
        self.failures[kind] += 1
        cause = None
        logged: list[str] = []
        if self.tap is not None:
            logged = self.tap.records[self._mark:]
            # the request's own exception (raised through protocols/), not a background task's
            own = [r for r in logged if " protocols/" in r or "(via protocols/" in r]
            cause = (own or logged or ["(nothing logged)"])[-1]
            self.causes[f"{kind} <- {cause}"] += 1
        ex = self.examples.setdefault(kind, [])
        # a few examples of each distinct cause
        if (self.causes[f"{kind} <- {cause}"] if cause else len(ex) + 1) <= EXAMPLES_PER_KIND and len(ex) < 10 * EXAMPLES_PER_KIND:
            ex.append({"mutation": m.how if m else None, "frame": m.frame if m else None, "payload": m.short() if m else None, "what": what[:400],
                       "cause": cause, "server_log": logged[-3:] if self.tap is not None else None})

    def result(self) -> dict[str, Any]:
        return {"sent": self.sent, "seconds": round(self.seconds, 2), "outcomes": dict(sorted(self.outcomes.items())),
                "failures": dict(sorted(self.failures.items())), "failed": sum(self.failures.values()), "examples": self.examples,
                "causes": dict(self.causes.most_common()), "seeds": self.seeds}


def _is_error_body(body: Any) -> bool:
    e = body.get("error") if isinstance(body, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) and isinstance(e.get("type"), str) and "param" in e and "code" in e


class Target:
    def __init__(self, base_url: str, http: aiohttp.ClientSession, api_key: str | None, timeout: float) -> None:
        self.base = base_url.rstrip("/")
        self.http = http
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def url(self, path: str, ws: bool = False) -> str:
        u = self.base + path
        return re.sub(r"^http", "ws", u) if ws else u


async def _http_call(t: Target, tally: Tally, m: Mutant, method: str, path: str, ctype: str | None,
                     after: Callable[[int, bytes, Any], Awaitable[None]] | None = None, data: Any = None) -> None:
    tally.sent += 1
    tally.mark()
    headers = dict(t.headers)
    if ctype:
        headers["content-type"] = ctype
    body = m.data.encode("utf-8", "surrogatepass") if isinstance(m.data, str) else m.data
    # A valid mutant may ask for a whole answer (chat with audio, no max_tokens): the
    # answer comes when it is generated, so HTTP gets HTTP_TIMEOUT_FACTOR x the timeout.
    budget = t.timeout * HTTP_TIMEOUT_FACTOR
    try:
        async with t.http.request(method, t.url(path), data=body if data is None else data, headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=budget)) as resp:
            try:
                raw = await resp.read()
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
                tally.fail("cut_stream", m, f"{resp.status} then the body was cut: {exc!r}")
                return
            status = resp.status
            headers_in = resp.headers
    except asyncio.TimeoutError:
        tally.fail("timeout", m, f"no answer within {budget}s")
        return
    except aiohttp.ClientError as exc:
        tally.fail("no_response", m, repr(exc))
        return
    try:
        parsed = json.loads(raw) if raw[:1] in (b"{", b"[") else None
    except ValueError:
        parsed = None
    if status >= 500:
        tally.fail("http_5xx", m, f"{status} {raw[:300]!r}")
    elif status >= 400:
        if parsed is not None and _is_error_body(parsed):
            tally.ok(f"{status} {parsed['error'].get('code')}", m)
        else:
            tally.fail("bad_error_shape", m, f"{status} {raw[:300]!r}")
    else:
        tally.ok(str(status), m)
        if after is not None:
            await after(status, raw, headers_in)


async def fuzz_http_json(t: Target, rng: random.Random, name: str, path: str, seeds: list[Any], n: int,
                         after: Callable[[int, bytes, Any], Awaitable[None]] | None = None) -> Tally:
    tally = Tally(name)
    t0 = time.perf_counter()
    for i in range(n):
        m = Mutant(dumps(seeds[i]), "seed (unmutated)") if i < len(seeds) else mutate_json(rng, seeds)
        await _http_call(t, tally, m, "POST", path, "application/json", after)
    tally.seconds = time.perf_counter() - t0
    return tally


async def fuzz_videos(t: Target, rng: random.Random, n: int) -> Tally:
    async def after(status: int, raw: bytes, headers: Any) -> None:
        try:
            vid = json.loads(raw)["id"]
        except (ValueError, KeyError, TypeError):
            return
        async with t.http.delete(t.url(f"/v1/videos/{vid}"), headers=t.headers) as r:
            await r.read()

    tally = Tally("videos")
    t0 = time.perf_counter()
    for i in range(n):
        if i == 0:
            m, ctype = Mutant(dumps(VIDEO), "seed (unmutated)"), "application/json"
        elif rng.random() < 0.5:  # the openai SDK sends multipart form fields
            body, ctype, how = mutate_form(rng, VIDEO)
            m = Mutant(body, how)
        else:
            m, ctype = mutate_json(rng, [VIDEO]), "application/json"
        await _http_call(t, tally, m, "POST", "/v1/videos", ctype, after)
    tally.seconds = time.perf_counter() - t0
    return tally


async def fuzz_webrtc(t: Target, rng: random.Random, n: int) -> Tally:
    tally = Tally("webrtc")
    t0 = time.perf_counter()

    async def hangup(status: int, raw: bytes, headers: Any) -> None:
        loc = headers.get("location")
        if loc:
            async with t.http.delete(t.url(loc), headers=t.headers) as r:
                await r.read()
                if r.status >= 500:
                    tally.fail("http_5xx", None, f"hang-up of {loc}: {r.status}")

    session_seed = realtime_seeds(False)[0]["session"]
    for i in range(n):
        if i == 0:
            await _http_call(t, tally, Mutant(dumps({"sdp": OFFER_SDP, "type": "offer", "session": session_seed}), "seed (unmutated)"),
                             "POST", "/offer", "application/json", hangup)
            continue
        if i == 1:
            await _http_call(t, tally, Mutant(OFFER_SDP, "seed (unmutated)"), "POST", "/v1/realtime/calls", "application/sdp", hangup)
            continue
        r = rng.random()
        if r < 0.45:  # POST /offer {sdp, type, session}
            seed = {"sdp": OFFER_SDP, "type": "offer"}
            if rng.random() < 0.4:
                seed["session"] = session_seed
            if rng.random() < 0.4:
                sdp, how = mutate_sdp(rng)
                seed["sdp"] = sdp
                if rng.random() < 0.8:
                    m = Mutant(dumps(seed), "sdp: " + how)
                else:
                    m = mutate_json(rng, [seed])
                    m.how = f"sdp: {how}; {m.how}"
            else:
                m = mutate_json(rng, [seed])
            await _http_call(t, tally, m, "POST", "/offer", "application/json", hangup)
        elif r < 0.9:  # POST /v1/realtime/calls, application/sdp
            sdp, how = mutate_sdp(rng)
            m = Mutant(sdp, how)
            if rng.random() < 0.15:
                data, h2 = _bytes_mutation(rng, sdp.encode())
                m = Mutant(data, f"{how}; {h2}")
            ctype = rng.choice(("application/sdp", "application/sdp", "text/plain", None, rng.choice(BAD_FORM_TYPES)))
            await _http_call(t, tally, m, "POST", "/v1/realtime/calls", ctype, hangup)
        else:  # multipart with a session
            sess, how = _structural(rng, session_seed, ())
            sdp = OFFER_SDP if rng.random() < 0.6 else mutate_sdp(rng)[0]
            form = aiohttp.FormData()
            form.add_field("sdp", sdp)
            form.add_field("session", dumps(sess))
            m = Mutant(dumps(sess), "multipart session: " + how)
            await _http_call(t, tally, m, "POST", "/v1/realtime/calls", None, hangup, data=form)
    tally.seconds = time.perf_counter() - t0
    return tally


PROBE = "fuzz.probe"


class JsonSocket:
    """One JSON event socket, reconnected when it closes."""

    def __init__(self, t: Target, path: str, headers: dict[str, str], first: str) -> None:
        self.t, self.path, self.headers, self.first = t, path, headers, first
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.connects = 0
        self.probe_n = 0

    async def connect(self) -> None:
        self.ws = await self.t.http.ws_connect(self.t.url(self.path, ws=True), headers={**self.t.headers, **self.headers},
                                               max_msg_size=0, autoping=True)
        self.connects += 1
        await self.read_until(lambda ev: ev.get("type") == self.first)

    async def read_until(self, done: Callable[[dict[str, Any]], bool]) -> tuple[list[dict[str, Any]], tuple[int | None, str] | None]:
        """Events until `done(ev)`, or the close (code, reason) when the socket closed first."""
        assert self.ws is not None
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.t.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            msg = await asyncio.wait_for(self.ws.receive(), left)
            if msg.type is aiohttp.WSMsgType.TEXT:
                try:
                    ev = json.loads(msg.data)
                except ValueError:
                    ev = {"type": "<invalid JSON from the server>", "raw": msg.data[:200]}
                seen.append(ev)
                if done(ev):
                    return seen, None
            elif msg.type is aiohttp.WSMsgType.BINARY:
                continue  # binary audio (duplex)
            else:
                return seen, (self.ws.close_code, str(msg.extra or ""))

    async def send(self, m: Mutant) -> None:
        assert self.ws is not None
        if m.frame == "binary":
            await self.ws.send_bytes(m.data if isinstance(m.data, bytes) else m.data.encode("utf-8", "surrogatepass"))
        elif m.frame == "text_bytes":
            data = m.data if isinstance(m.data, bytes) else m.data.encode("utf-8", "surrogatepass")
            await self.ws._writer.send_frame(data, aiohttp.WSMsgType.TEXT)  # noqa: SLF001 - a text frame that is not UTF-8
        else:
            await self.ws.send_str(m.data if isinstance(m.data, str) else m.data.decode("utf-8", "replace"))

    async def close(self) -> None:
        if self.ws is not None and not self.ws.closed:
            await self.ws.close()


def _server_fault(ev: dict[str, Any]) -> bool:
    if ev.get("type") != "error":
        return False
    e = ev.get("error") or {}
    return e.get("code") == "internal_error" or (e.get("type") == "server_error" and e.get("code") not in ("engine_unavailable",))


async def fuzz_json_ws(t: Target, rng: random.Random, name: str, path: str, seeds: list[Any], n: int,
                       headers: dict[str, str] | None = None, extra: Callable[[random.Random], Mutant] | None = None,
                       close_event: str | None = None) -> Tally:
    """Mutated events on one socket, each followed by a probe that must be answered."""
    tally = Tally(name)
    t0 = time.perf_counter()
    sock = JsonSocket(t, path, headers or {}, "session.created")
    try:
        for i in range(n):
            if sock.ws is None or sock.ws.closed:
                try:
                    await sock.connect()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    tally.fail("connect_failed", None, repr(exc))
                    await asyncio.sleep(0.05)
                    continue
            if i < len(seeds):
                m = Mutant(dumps(seeds[i]), "seed (unmutated)")
            else:
                m = extra(rng) if extra is not None and rng.random() < 0.12 else mutate_json(rng, seeds)
            tally.sent += 1
            tally.mark()
            sock.probe_n += 1
            pid = f"fzp_{sock.probe_n}"
            try:
                await sock.send(m)
                await sock.ws.send_str(json.dumps({"type": PROBE, "event_id": pid}))  # type: ignore[union-attr]
                def answers(ev: dict[str, Any], pid: str = pid) -> bool:
                    return ev.get("type") == "error" and (ev.get("error") or {}).get("event_id") == pid

                seen, closed = await sock.read_until(answers)
            except asyncio.TimeoutError:
                tally.fail("probe_timeout", m, f"no answer to the probe within {t.timeout}s")
                await sock.close()
                continue
            except (ConnectionError, aiohttp.ClientError) as exc:
                tally.fail("ws_close", m, f"send failed, the socket is gone: {exc!r}")
                continue
            faults = [ev for ev in seen if _server_fault(ev)]
            if closed is not None:
                code, reason = closed
                errs = [(ev.get("error") or {}).get("code") for ev in seen if ev.get("type") == "error"]
                if m.frame == "text_bytes":  # RFC 6455: a text frame that is not UTF-8 fails the connection (1007)
                    tally.ok(f"closed {code} (text frame not UTF-8: the transport's rule)", m)
                elif close_event and any(ev.get("type") == close_event for ev in seen) and code == 1000:
                    tally.ok(f"closed 1000 after {close_event}", m)
                else:
                    tally.fail("ws_close", m, f"closed {code} {reason!r} instead of an error event; error codes before: {errs}")
                continue
            if faults:
                tally.fail("server_error_event", m, json.dumps(faults[0])[:300])
            else:
                kinds = [(ev.get("error") or {}).get("code") for ev in seen[:-1] if ev.get("type") == "error"]
                tally.ok(f"error {kinds[0]}" if kinds else "accepted", m)
    finally:
        if sock.ws is not None and not sock.ws.closed and close_event:
            try:
                await sock.ws.send_str(json.dumps({"type": "session.close"}))
                await sock.read_until(lambda ev: ev.get("type") == close_event)
            except (asyncio.TimeoutError, ConnectionError, aiohttp.ClientError):
                pass
        await sock.close()
        tally.outcomes["connections"] = sock.connects
    tally.seconds = time.perf_counter() - t0
    return tally


OPENPI_FAULT_TEXT = "internal error in the policy server"


async def fuzz_openpi(t: Target, rng: random.Random, n: int) -> Tally:
    tally = Tally("openpi")
    t0 = time.perf_counter()
    seeds = openpi_seeds()
    ws: aiohttp.ClientWebSocketResponse | None = None
    connects = 0
    try:
        for i in range(n):
            if ws is None or ws.closed:
                try:
                    ws = await t.http.ws_connect(t.url("/v1/openpi", ws=True), headers=t.headers, max_msg_size=0)
                    connects += 1
                    meta = await asyncio.wait_for(ws.receive(), t.timeout)
                    if meta.type is not aiohttp.WSMsgType.BINARY:
                        tally.fail("bad_metadata", None, f"first frame {meta.type} {str(meta.data)[:200]}")
                        await ws.close()
                        continue
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    tally.fail("connect_failed", None, repr(exc))
                    continue
            if i < len(seeds):
                import msgpack

                m = Mutant(msgpack.packb(seeds[i]), "seed (unmutated)", "binary")
            else:
                m = mutate_openpi(rng, seeds)
            tally.sent += 1
            tally.mark()
            try:
                if m.frame == "binary":
                    await ws.send_bytes(m.data if isinstance(m.data, bytes) else m.data.encode())
                else:
                    await ws.send_str(m.data if isinstance(m.data, str) else m.data.decode("utf-8", "replace"))
                msg = await asyncio.wait_for(ws.receive(), t.timeout)
                if msg.type is aiohttp.WSMsgType.BINARY:
                    tally.ok("reply", m)
                    continue
                text = msg.data if msg.type is aiohttp.WSMsgType.TEXT else None
                if text is not None:
                    msg = await asyncio.wait_for(ws.receive(), t.timeout)
                code = ws.close_code
                if text is None:
                    tally.fail("ws_close_without_text", m, f"closed {code} {msg.extra!r} with no text frame")
                elif text.startswith(OPENPI_FAULT_TEXT):
                    tally.fail("server_fault", m, f"{text!r}, close {code}")
                elif code not in (1011, 1013, 1009):
                    tally.fail("bad_close_code", m, f"{text!r}, close {code}")
                else:
                    tally.ok(f"text+{code}", m)
            except asyncio.TimeoutError:
                tally.fail("timeout", m, f"no answer within {t.timeout}s")
                await ws.close()
            except (ConnectionError, aiohttp.ClientError) as exc:
                tally.fail("ws_close_without_text", m, repr(exc))
    finally:
        if ws is not None:
            await ws.close()
        tally.outcomes["connections"] = connects
    tally.seconds = time.perf_counter() - t0
    return tally
