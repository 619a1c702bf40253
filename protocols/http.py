"""The HTTP kit of the OpenAI-style APIs (aiohttp's server).

- Errors: `error_middleware` answers every `OmniError` with OpenAI's error body and its
  status (+ headers such as `retry-after`), aiohttp's own HTTP errors (404, 405, 413
  for a body over `client_max_size`) in the same shape, and anything unexpected with a
  logged traceback and a generic 500.
- Bodies: `read_json` (the body as JSON, or a clear 400) and `validate_body` (a pydantic
  model; the first bad field becomes the error's `param`). Bodies have a size limit
  (`Limits`: a few MB, more for requests that carry media): a body over it is refused
  with 413 by its `Content-Length` before it is read, or as soon as a chunked body
  passes it. Large bodies are parsed off the event loop.
- Replies: `json_response`, and `Streamed` + `send_streamed` for bodies that stream as
  the pipeline produces them (speech audio, SSE); a client that stops reading one for
  `Limits.send_timeout_s` is cut off, which frees what the reply held.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from omni_rt.errors import ClientError, NotFound, OmniError
from protocols.errors import error_body, to_omni
from protocols.wire_json import load_json
from protocols.ws import DISCONNECTED

log = logging.getLogger("protocols.http")

M = TypeVar("M", bound=BaseModel)

# bodies larger than this are parsed in a worker thread (the loop keeps serving)
PARSE_OFF_LOOP_BYTES = 256 << 10


@dataclass(frozen=True)
class Limits:
    """The HTTP limits of a server (deploy `server.max_body_bytes`, …)."""

    max_body_bytes: int = 4 << 20
    max_upload_bytes: int = 64 << 20
    send_timeout_s: float = 30.0


LIMITS = web.AppKey("http_limits", Limits)


def limits_of(request: web.Request) -> Limits:
    return request.app.get(LIMITS) or Limits()


def _too_large(limit: int) -> ClientError:
    return ClientError(f"The request body is larger than this server takes ({limit} bytes).", code="request_too_large", http_status=413)


def check_length(request: web.Request, limit: int) -> None:
    """Refuse a body whose declared length is over `limit` before reading any of it."""
    n = request.content_length
    if n is not None and n > limit:
        raise _too_large(limit)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, read up to `limit` bytes (413 past it, by Content-Length or as it streams)."""
    check_length(request, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _dumps(obj: Any) -> str:
    # compact, UTF-8 as is (the bytes earlier releases sent)
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(body: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(text=_dumps(body), status=status, content_type="application/json", headers=headers)


def error_response(exc: OmniError) -> web.Response:
    return json_response(error_body(exc), status=exc.http_status, headers=exc.headers)


def _http_error(request: web.Request, exc: web.HTTPException) -> OmniError:
    if exc.status == 404:
        return NotFound(f"Unknown path {request.path}")
    if exc.status == 405:
        return ClientError(f"Method {request.method} is not allowed on {request.path}", code="method_not_allowed", http_status=405)
    if exc.status == 413:
        limit = request.app._client_max_size  # noqa: SLF001 - aiohttp keeps the limit only here
        return ClientError(f"The request body is larger than {limit} bytes.", code="request_too_large", http_status=413)
    return ClientError(exc.reason or "Bad request", code="bad_request", http_status=exc.status)


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except OmniError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like
        return error_response(_http_error(request, exc))
    except asyncio.CancelledError:
        raise
    except DISCONNECTED:
        raise  # the client left: nothing to answer
    except Exception as exc:  # noqa: BLE001 - the one catch-all of the HTTP side
        return error_response(to_omni(exc, f"{request.method} {request.path}"))


async def read_json(request: web.Request, upload: bool = False) -> Any:
    """The body as JSON (413 past the body limit: `upload`, the larger one for
    requests that carry media)."""
    lim = limits_of(request)
    body = await read_body(request, lim.max_upload_bytes if upload else lim.max_body_bytes)
    if not body:
        raise ClientError("The request body is empty; expected a JSON object.", code="invalid_json")
    if len(body) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(load_json, body, "The request body")
    return load_json(body, "The request body")


# error types a validator may raise itself (PydanticCustomError): they are the wire code
WIRE_CODES = frozenset({"invalid_value", "invalid_type", "unknown_parameter", "missing_required_parameter"})


async def read_form(request: web.Request, too_large: ClientError | None = None) -> dict[str, Any]:
    """A `multipart/form-data` or `application/x-www-form-urlencoded` body as one value per
    field: text, or aiohttp's `FileField` for a file part. A body that cannot be read (no
    or a wrong boundary, text that is not in its charset, an unknown charset) is the
    client's 400, a field sent twice too (which one was meant?); past the body limit,
    `too_large` (default: the body limit's 413)."""
    try:
        form = await request.post()
    except web.HTTPRequestEntityTooLarge:
        if too_large is not None:
            raise too_large from None
        raise
    except (ValueError, LookupError, AssertionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ClientError(f"The {request.content_type} body could not be read: {exc}", code="invalid_form") from None
    out: dict[str, Any] = {}
    for k, v in form.items():
        if k in out:
            raise ClientError(f"The form field '{k}' is given more than once.", param=k, code="invalid_value")
        out[k] = v
    return out


def validation_error(errors: list[Any], prefix: str = "", type_code: str = "invalid_value") -> ClientError:
    """pydantic's first error as OpenAI's 400, its field path (under `prefix`) as
    `param`. A wrong JSON type gets `type_code` (the Realtime API says invalid_type)."""
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p not in ("body",)]
    param = ".".join([prefix, *loc] if prefix else loc) or None
    kind = e.get("type", "")
    msg = e.get("msg", "invalid value")
    if kind in WIRE_CODES:
        return ClientError(msg, param=param, code=kind)
    if kind == "missing":
        return ClientError(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return ClientError(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind in ("json_invalid", "model_attributes_type", "dict_type") and not prefix:
        return ClientError(f"The request body is not valid JSON: {msg}", code="invalid_json")
    code = type_code if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return ClientError(f"Invalid value for '{param}': {msg}.", param=param, code=code)


def validate_body(model: type[M], raw: Any) -> M:
    """A JSON body as `model`, or the OpenAI-shaped 400 naming the first bad field."""
    if not isinstance(raw, dict):
        raise ClientError("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise validation_error(list(err.errors())) from None


def sse(data: Any, event: str | None = None) -> bytes:
    """One Server-Sent Events message (`text/event-stream`): an optional `event:` line
    and one `data:` line of compact JSON (a str is sent as is, e.g. `[DONE]`). JSON
    never holds a raw newline, so one data line carries the whole message."""
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {body}\n\n".encode()


@dataclass
class Streamed:
    """A body that streams as the pipeline produces it. `close` runs however the
    response ends, even when the client left before the first byte (it ends the
    request's session)."""

    body: AsyncIterator[bytes]
    content_type: str
    close: Callable[[], Awaitable[None]]
    headers: dict[str, str] = field(default_factory=dict)


async def prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first` (an item taken from `rest` before the reply started; None: `rest` had
    none), then the rest of `rest`."""
    if first is None:
        return
    yield first
    async for x in rest:
        yield x


class _SendWatchdog:
    """Cancels the sending task when one write has waited `timeout` seconds for the
    client to read (a timer every timeout / 4; a write costs two assignments, not a
    task per chunk as `asyncio.wait_for` would)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.writing: float | None = None  # loop time the pending write started
        self.fired = False
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._handle = self._loop.call_later(timeout / 4, self._check)

    def _check(self) -> None:
        since = self.writing
        if since is not None and self._loop.time() - since >= self.timeout and self._task is not None:
            self.fired = True
            self._task.cancel()
        else:
            self._handle = self._loop.call_later(self.timeout / 4, self._check)

    def absorb(self) -> None:
        """The cancellation was ours: the task goes on (its own cancel count restored)."""
        uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+
        if uncancel is not None:
            uncancel()

    def stop(self) -> None:
        self._handle.cancel()


async def send_streamed(request: web.Request, reply: Streamed) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers=reply.headers)
    resp.content_type = reply.content_type
    stalled = _SendWatchdog(limits_of(request).send_timeout_s)
    try:
        await resp.prepare(request)
        async for chunk in reply.body:
            stalled.writing = asyncio.get_running_loop().time()
            await resp.write(chunk)  # waits while the client does not read
            stalled.writing = None
        await resp.write_eof()
    except asyncio.CancelledError:
        if not stalled.fired:
            raise
        stalled.absorb()
        # the client stopped reading: as good as gone (its session is freed below)
        log.info("%s %s: the client read nothing for %.0f s; the reply is cut off", request.method, request.path, stalled.timeout)
        if request.transport is not None:
            request.transport.abort()
    except DISCONNECTED:
        pass  # the client left; `close` frees what the request held
    except Exception as exc:
        if not resp.prepared:
            raise
        # The headers are out: end the connection without terminating the chunked
        # body, so the client sees a cut stream rather than a complete one.
        to_omni(exc, f"{request.method} {request.path} (streaming)")
        if request.transport is not None:
            request.transport.close()
    finally:
        stalled.stop()
        aclose = getattr(reply.body, "aclose", None)
        if aclose is not None:
            await asyncio.shield(aclose())
        await asyncio.shield(reply.close())
    return resp
