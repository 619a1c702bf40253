"""One WebRTC call: the caller's RTP audio into the conversation, the conversation's
events onto the `oai-events` data channel, its answer audio onto the paced track
(`TrackOutput`)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import numpy as np
import soxr

from omni_rt import metrics
from omni_rt.errors import ClientError
from protocols.realtime import RATE, Config, Conversation, apply_session_update, wire_data
from protocols.webrtc.track import TrackOutput
from sessions import END_EVENTS, Session, SessionManager

log = logging.getLogger("protocols.webrtc")

MAX_DC_BUFFERED = 8 << 20  # bytes queued on the data channel
IN_BATCH_MS = 60  # inbound audio handed to VAD/encoder in batches of this much


class WebRTCTransport:
    """What a call plugs into its conversation: the track output, and the data
    channel's own rules (no audio events: audio is RTP)."""

    tag_epochs = False

    def __init__(self, output: TrackOutput) -> None:
        self.output = output

    def update_session(self, conv: Conversation, body: Any) -> Config:
        return apply_session_update(conv.cfg, body, conv.pipeline.voices)

    def session_wire(self, conv: Conversation) -> dict[str, Any]:
        return conv.cfg.wire(True, conv.session.id)

    async def on_event(self, conv: Conversation, type: str, ev: dict[str, Any], event_id: str | None) -> bool:
        if type in ("input_audio_buffer.append", "input_audio_buffer.commit") and conv.cfg.turn_detection is not None:
            # audio comes over RTP; with server VAD there is nothing to append or commit
            raise ClientError(f"'{type}' is not used on a WebRTC call: audio arrives over RTP.", param="type")
        if type == "output_audio_buffer.clear":
            await conv.interrupt("client_cancelled")
            return True
        return False


class Call:
    def __init__(self, session: Session, sessions: SessionManager, conv: Conversation, output: TrackOutput, pc: Any) -> None:
        self.session = session
        self.sessions = sessions
        self.conv = conv
        self.output = output
        self.pc = pc
        self.channel: Any = None
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def pump_in(self, track: Any) -> None:
        """Caller audio → 24 kHz mono → VAD / encoder, in small batches."""
        from aiortc.mediastreams import MediaStreamError

        rs: soxr.ResampleStream | None = None
        rate = None
        batch: list[np.ndarray] = []
        have = 0
        try:
            while True:
                frame = await track.recv()
                x = frame.to_ndarray()
                channels = len(frame.layout.channels)
                if x.dtype != np.int16:
                    x = (np.clip(x.astype(np.float32), -1, 1) * 32767).astype(np.int16)
                pcm = x.reshape(-1, channels).astype(np.float32).mean(axis=1) / 32768.0
                if frame.sample_rate != rate:
                    rate = frame.sample_rate
                    rs = soxr.ResampleStream(rate, RATE, 1, dtype="float32") if rate != RATE else None
                y = rs.resample_chunk(pcm) if rs is not None else pcm
                batch.append(y)
                have += len(y)
                if have * 1000 >= IN_BATCH_MS * RATE:
                    chunk = np.concatenate(batch)
                    batch, have = [], 0
                    self.session.touch()
                    try:
                        await self.conv.input.append_pcm(chunk)
                    except ClientError as exc:  # refused audio (a full buffer): said on the channel, the call goes on
                        self.conv.error(exc)
        except MediaStreamError:
            pass  # the caller's track ended
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a broken inbound track ends the call
            log.exception("call %s: inbound audio failed", self.session.id)

    async def pump_out(self) -> None:
        """Session events → the data channel (JSON)."""
        ch = self.channel
        async for ev in self.session.events():
            if ev.fence is not None and ev.fence.is_stale_against(self.session.fence):
                metrics.DROPPED_STALE.labels(hop="adapter").inc()
                continue
            if ch is None or ch.readyState != "open":
                continue
            if ch.bufferedAmount > MAX_DC_BUFFERED:
                self.sessions.end_soon(self.session, "slow_consumer")
                continue
            ch.send(json.dumps({"type": ev.type, "event_id": f"event_{ev.seq:06d}", **wire_data(ev.data)}))
            if ev.type in END_EVENTS:
                break

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.conv.shutdown("call_ended")
        self.output.track.track.stop()
        try:
            await self.pc.close()
        except Exception as exc:  # noqa: BLE001 - aiortc fails closing some half-negotiated connections; nothing is left to free
            log.info("call %s: closing the peer connection raised %r", self.session.id, exc)
