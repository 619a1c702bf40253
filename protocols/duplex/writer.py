"""The duplex writer of one attachment: events as they come, or with pacing "realtime",
audio cut into 20 ms frames sent in real time (`pacing_lead_s` ahead) with the other
events in order between them.

Paced, it knows when a client playing the frames as they arrive runs dry within an
answer: `omni_rt_playout_underrun_seconds{cause}` counts each hole, "generation" when
the writer had no audio to send (the pipeline was late), "client" when the socket's send
waited for the most of it (its client is not reading: its own problem, ended as a
`slow_consumer` after `send_timeout_s`), "send" when it had audio and a free socket but
ran late itself (the server's loop did not run). Load-aware admission reads the
server's holes, generation and send (`SessionManager.meters.playout`), never a client's.

Unsent events go back to the session when the attachment ends and are replayed on
resume, including the unsent rest of an answer the writer was in the middle of (kept
at the output rate it was already converted to). A barge-in drops the unsent old
audio: it fails the fence check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace

from omni_rt import metrics
from protocols.duplex.transport import AUDIO_DELTA, RENDERED, DuplexTransport, format_tag
from protocols.ws import Socket
from sessions import END_EVENTS, Session, SessionEvent, SessionManager

log = logging.getLogger("protocols.duplex")


async def write(t: DuplexTransport, sock: Socket, session: Session, sessions: SessionManager) -> None:
    pending: deque[SessionEvent] = deque()
    t.outbox = pending
    wake, room = asyncio.Event(), asyncio.Event()
    over = False
    timing = t.timing

    async def pull() -> None:
        nonlocal over
        async for ev in session.events():
            pending.append(ev)
            wake.set()
            # Unpaced, take one event at a time: a client that does not read then
            # backs up the session's own queue (its slow-consumer bound). Paced,
            # events wait here for their time.
            while pending and not t.paced:
                room.clear()
                await room.wait()
        over = True
        wake.set()

    blocked = 0.0  # seconds the socket's sends waited since the last hole check

    async def send(out: str | bytes) -> None:
        nonlocal blocked
        if not t.paced:
            await sock.send(out)
            return
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(sock.send(out), timing.send_timeout_s)
            blocked += time.monotonic() - t0
        except asyncio.TimeoutError:
            # its player ran dry for as long: the client's own hole, the last it hears
            metrics.PLAYOUT_UNDERRUN_SECONDS.labels("duplex", "client").observe(timing.send_timeout_s)
            log.warning("duplex session %s: the client has not read for %.0f s; ending it", session.id, timing.send_timeout_s)
            sessions.end_soon(session, "slow_consumer")
            raise

    def taken() -> None:
        pending.popleft()
        room.set()

    puller = asyncio.get_running_loop().create_task(pull())
    clock, ahead = 0.0, 0.0  # the stream clock and the audio seconds sent on it
    answer: object = None  # the answer on the stream clock (another starts it again)
    starved = False  # the writer waited for audio since its last frame
    try:
        while True:
            if not pending:
                if over:
                    return
                wake.clear()
                starved = True
                await wake.wait()
                continue
            ev = pending[0]
            if ev.fence is not None and ev.fence.is_stale_against(session.fence):
                metrics.DROPPED_STALE.labels(hop="adapter").inc()
                taken()
                continue
            tail = t.tail(ev)
            if tail is not None:  # the answer's last resampled ms go out before its audio.done
                pending.appendleft(tail)
                continue
            if ev.type != AUDIO_DELTA or not t.paced:
                await send(t.frame(ev))
                taken()
                if ev.type in END_EVENTS and ev.data.get("session_id") == session.id:
                    return  # this session's end (not a refused resume of another)
                continue
            pcm = t.out_audio(ev)
            taken()
            if (this := (ev.fence, ev.data.get("response_id"))) != answer:  # another answer: the silence before it is no hole
                answer, clock, ahead = this, 0.0, 0.0
            step = t.out_fmt.bytes_per_sample * t.out_rate // 50  # 20 ms
            i = 0
            t.sending_audio = True
            try:
                while i < len(pcm):
                    now = time.monotonic()
                    if now > clock + ahead:  # idle or behind: the stream clock starts again
                        if ahead > 0:  # within an answer: the client's playback ran dry
                            hole = now - clock - ahead
                            cause = "generation" if starved else "client" if blocked >= hole / 2 else "send"
                            metrics.PLAYOUT_UNDERRUN_SECONDS.labels("duplex", cause).observe(hole)
                            if cause != "client":  # a client that does not read harms no one else
                                sessions.meters.playout.hole(hole)
                        clock, ahead = now, 0.0
                    blocked = 0.0
                    starved = False
                    due = clock + ahead - timing.pacing_lead_s
                    if due > now:
                        await asyncio.sleep(due - now)
                    if ev.fence is not None and ev.fence.is_stale_against(session.fence):
                        break  # barge-in / cancel: the rest of this answer is dropped
                    part = pcm[i : i + step]
                    await send(t.render(ev.type, {**ev.data, "delta": part}))
                    i += len(part)
                    ahead += len(part) / t.out_fmt.bytes_per_sample / t.out_rate
            except BaseException:
                if i < len(pcm):  # the socket went away mid-answer: keep what it did not get
                    pending.appendleft(replace(ev, data={**ev.data, "delta": pcm[i:], RENDERED: format_tag(t.out_fmt)}))
                raise
            finally:
                t.sending_audio = False
    finally:
        puller.cancel()
        await asyncio.gather(puller, return_exceptions=True)
        if t.outbox is pending:
            t.outbox = None
        session.requeue(pending)
