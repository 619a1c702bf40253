"""Phone calls under call control, in the shape of OpenAI's Realtime Calls API.

A call (a telephony stream, `protocols.telephony`) is a voice conversation whose audio
flows on the phone leg. With `server.call_webhook_url` set, a new call rings: the
server POSTs a `realtime.call.incoming` event there, signed the Standard Webhooks way
with `server.call_webhook_secret` (`client.webhooks.unwrap` verifies it), and the
call's audio is not heard until the app answers:

- `POST /v1/realtime/calls/{call_id}/accept` with the session's configuration (the body
  of `client.realtime.calls.accept`: `instructions`, `audio.output.voice`, `tools`,
  `max_output_tokens`, …; the phone leg's audio format stays μ-law);
- `POST /v1/realtime/calls/{call_id}/reject` (`status_code`): the stream is closed;
- `POST /v1/realtime/calls/{call_id}/refer`: a transfer is not supported on a media
  stream (400 `unsupported_on_transport`, naming the transport);
- `POST /v1/realtime/calls/{call_id}/hangup` (and `DELETE /v1/realtime/calls/{call_id}`):
  the call ends.

A call not accepted within `server.call_accept_timeout_s` is rejected. Without a webhook
(the default) a call is accepted at once with the deploy's default session and its
stream's parameters. While it runs, `GET /v1/realtime?call_id=…` attaches a **sideband**
control socket: the conversation's events (transcripts, responses, function calls) go
to it, and what it sends (`session.update`, `response.create`,
`conversation.item.create` with a `function_call_output`, …) goes to the conversation,
while the audio stays on the phone leg. One sideband at a time; a new one replaces the
old (closed with 1000). The call's id is its session's id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import weakref
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import httpx
from aiohttp import web

from omni_rt.errors import ClientError, NotFound
from protocols.auth import principal_of
from protocols.http import read_json
from protocols.ws import DISCONNECTED, accept, numbered_json
from sessions import SessionEvent

if TYPE_CHECKING:
    from protocols.realtime import Conversation
    from sessions import Session, SessionManager

__all__ = ["CallRegistry", "PhoneCall", "calls_of", "registry"]

log = logging.getLogger("protocols.calls")

SIDEBAND_QUEUE = 4096  # events waiting for a slow sideband before it is dropped
WEBHOOK_TIMEOUT_S = 10.0


class PhoneCall:
    """One call: its session and conversation, whether it was answered, its sideband."""

    def __init__(self, session: Session, conv: Conversation, transport: str, sip_headers: list[dict[str, str]]) -> None:
        self.session = session
        self.conv = conv
        self.call_id = session.id
        self.transport = transport  # "twilio"
        self.sip_headers = sip_headers
        self.answer: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._sideband: web.WebSocketResponse | None = None
        self._queue: asyncio.Queue[str | None] | None = None
        self._frame = numbered_json(_wire_data)

    @property
    def accepted(self) -> bool:
        return self.answer.done() and self.answer.result() is not None

    # ---- the sideband -------------------------------------------------------------------------
    def forward(self, ev: SessionEvent) -> None:
        """A conversation event, to the sideband if one is attached."""
        q = self._queue
        if q is None:
            return
        if q.qsize() >= SIDEBAND_QUEUE:
            log.warning("call %s: the sideband does not read its events; detached", self.call_id)
            q.put_nowait(None)
            self._queue = None
            return
        q.put_nowait(self._frame(ev))

    async def attach(self, request: web.Request) -> web.StreamResponse:
        """`/v1/realtime?call_id=`: the call's control socket, until it or the call closes."""
        sock = await accept(request)
        if self._queue is not None:
            self._queue.put_nowait(None)  # the earlier sideband's writer ends; its socket closes
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._queue = queue
        conv = self.conv
        queue.put_nowait(self._frame(SessionEvent("session.created", {"session": conv.cfg.wire(True, self.session.id)})))

        async def write() -> None:
            while (text := await queue.get()) is not None:
                await sock.send(text)

        writer = asyncio.get_running_loop().create_task(write())
        ended = asyncio.ensure_future(self.session.closed.wait())
        try:
            while (data := await sock.receive(writer, ended)) is not None:
                await conv.handle(data)
        except DISCONNECTED:
            pass
        finally:
            ended.cancel()
            if self._queue is queue:
                self._queue = None
            if self.session.closed.is_set():  # the call ended: its last events still go out
                queue.put_nowait(None)
                await asyncio.wait({writer}, timeout=0.5)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await sock.close(1000, "call ended" if self.session.closed.is_set() else "sideband closed")
        return sock.ws


def _wire_data(data: Any) -> Any:
    from protocols.realtime import wire_data

    return wire_data(data)


class CallRegistry:
    """The calls of one server, and how a new one is answered."""

    def __init__(self, sessions: SessionManager, webhook_url: str | None, webhook_secret: str | None, accept_timeout_s: float) -> None:
        self.sessions = sessions
        self.webhook_url = webhook_url
        self.webhook_secret = webhook_secret
        self.accept_timeout_s = accept_timeout_s
        self.calls: dict[str, PhoneCall] = {}
        self.mounted = False

    def add(self, call: PhoneCall) -> None:
        self.calls[call.call_id] = call

        async def gone() -> None:
            self.calls.pop(call.call_id, None)
            if not call.answer.done():
                call.answer.set_result(None)

        call.session.add_finalizer(gone)

    def get(self, request: web.Request, call_id: str) -> PhoneCall:
        """The call `call_id` if the caller may control it (its principal, or an admin)."""
        call = self.calls.get(call_id)
        who = principal_of(request)
        if call is None or not (who.admin or who.name == call.session.principal):
            raise NotFound(f"No call '{call_id}'.", code="call_not_found")
        return call

    async def ring(self, call: PhoneCall) -> dict[str, Any] | None:
        """Answer a new call: at once with no webhook ({}), else the app's accept (its
        session configuration), or None (rejected, not answered in time, or the webhook
        could not be delivered)."""
        if self.webhook_url is None:
            if not call.answer.done():
                call.answer.set_result({})
            return call.answer.result()
        msg_id = f"evt_{secrets.token_hex(12)}"
        event = {"id": msg_id, "object": "event", "type": "realtime.call.incoming", "created_at": int(time.time()),
                 "data": {"call_id": call.call_id, "sip_headers": call.sip_headers}}
        body = json.dumps(event, separators=(",", ":"))
        try:
            await self._deliver(msg_id, body)
        except (httpx.HTTPError, httpx.InvalidURL, ClientError) as exc:
            if call.answer.done():  # the app answered while the delivery was still going
                return call.answer.result()
            log.warning("call %s: the call webhook %s was not delivered (%s); rejected", call.call_id, self.webhook_url, exc)
            call.answer.set_result(None)
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(call.answer), self.accept_timeout_s)
        except asyncio.TimeoutError:
            log.info("call %s: not accepted within %.0f s; rejected", call.call_id, self.accept_timeout_s)
            if not call.answer.done():
                call.answer.set_result(None)
            return None

    async def _deliver(self, msg_id: str, body: str) -> None:
        from standardwebhooks import Webhook

        assert self.webhook_url is not None and self.webhook_secret is not None
        now = datetime.now(tz=timezone.utc)
        signature = Webhook(self.webhook_secret).sign(msg_id, now, body)
        headers = {"content-type": "application/json", "webhook-id": msg_id, "webhook-timestamp": str(int(now.timestamp())),
                   "webhook-signature": signature}
        async with httpx.AsyncClient(timeout=WEBHOOK_TIMEOUT_S) as client:
            r = await client.post(self.webhook_url, content=body, headers=headers)
        if r.status_code // 100 != 2:
            raise ClientError(f"the webhook answered {r.status_code}")

    # ---- the control routes ----------------------------------------------------------------------
    def mount(self, add_route: Any, apply_config: Any) -> None:
        """Accept, reject and refer. `apply_config(call, body)` applies an accept's session
        configuration to the call's conversation (ClientError naming a bad field). Once
        per server (several telephony wires share them)."""
        if self.mounted:
            return
        self.mounted = True

        async def accept_call(request: web.Request) -> web.StreamResponse:
            call = self.get(request, request.match_info["call_id"])
            body = await read_json(request)
            if not isinstance(body, dict):
                raise ClientError("The body is the session's configuration: a JSON object.")
            if call.answer.done():
                raise ClientError(f"Call '{call.call_id}' was already {'accepted' if call.accepted else 'rejected'}.", code="call_already_answered")
            apply_config(call, body)
            call.answer.set_result(body)
            return web.Response(status=200)

        async def reject_call(request: web.Request) -> web.StreamResponse:
            call = self.get(request, request.match_info["call_id"])
            body = await read_json(request) if request.can_read_body else {}
            code = body.get("status_code", 603) if isinstance(body, dict) else 603
            if not isinstance(code, int) or isinstance(code, bool) or not 400 <= code <= 699:
                raise ClientError("'status_code' is a SIP status code (400-699).", param="status_code")
            if call.answer.done():
                raise ClientError(f"Call '{call.call_id}' was already {'accepted' if call.accepted else 'rejected'}.", code="call_already_answered")
            call.answer.set_result(None)
            return web.Response(status=200)

        async def refer_call(request: web.Request) -> web.StreamResponse:
            call = self.get(request, request.match_info["call_id"])
            raise ClientError(f"A transfer (refer) is not supported on a {call.transport} media stream; "
                              "transfer the call with the provider's own API (TwiML <Dial>).", code="unsupported_on_transport", param="target_uri")

        add_route("POST", "/v1/realtime/calls/{call_id}/accept", accept_call, "accept a ringing phone call with its session")
        add_route("POST", "/v1/realtime/calls/{call_id}/reject", reject_call, "reject a ringing phone call")
        add_route("POST", "/v1/realtime/calls/{call_id}/refer", refer_call)


_REGISTRIES: weakref.WeakKeyDictionary[Any, CallRegistry] = weakref.WeakKeyDictionary()


def registry(sessions: SessionManager, server: Any) -> CallRegistry:
    """The calls of the server whose session manager is `sessions` (made once, from its
    `server` settings)."""
    reg = _REGISTRIES.get(sessions)
    if reg is None:
        reg = _REGISTRIES[sessions] = CallRegistry(sessions, server.call_webhook_url, server.call_webhook_secret, server.call_accept_timeout_s)
    return reg


def calls_of(sessions: SessionManager) -> CallRegistry | None:
    """The server's call registry, if a telephony wire made one."""
    return _REGISTRIES.get(sessions)
