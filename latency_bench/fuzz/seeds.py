"""Valid seed messages of every wire (realtime GA / beta, duplex, world, live video, the
HTTP APIs, WebRTC offers, OpenPI observations) and their wire-specific mutators."""

from __future__ import annotations

import base64
import copy
import json
import random
import re
from typing import Any

from latency_bench.fuzz.mutate import Mutant, _bytes_mutation, _get, _paths, _set

# ---- seeds ----------------------------------------------------------------------------------

PCM_B64 = base64.b64encode(bytes(960)).decode()  # 20 ms of silence at 24 kHz


def _wav_b64() -> str:
    import io

    from clients.realtime import write_wav_pcm16

    buf = io.BytesIO()
    write_wav_pcm16(buf, bytes(4800), 24000)  # 100 ms of silence
    return base64.b64encode(buf.getvalue()).decode()


WAV_B64 = _wav_b64()


def realtime_seeds(beta: bool) -> list[dict[str, Any]]:
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}
    audio_item = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": PCM_B64, "transcript": "hm"}]}
    upd: dict[str, Any]
    resp: dict[str, Any]
    if beta:
        upd = {"modalities": ["text"], "voice": "alloy", "instructions": "Be brief.", "input_audio_format": "pcm16",
               "output_audio_format": "pcm16", "turn_detection": None, "temperature": 0.8, "max_response_output_tokens": 3}
        resp = {"modalities": ["text"], "instructions": "short", "max_output_tokens": 2, "temperature": 0.7, "voice": "alloy"}
    else:
        upd = {"type": "realtime", "output_modalities": ["text"], "instructions": "Be brief.", "max_output_tokens": 3,
               "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                   "turn_detection": {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                                      "silence_duration_ms": 500, "create_response": False, "interrupt_response": True}},
                         "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy", "speed": 1.0}}}
        resp = {"output_modalities": ["text"], "instructions": "short", "max_output_tokens": 2}
    return [
        {"type": "session.update", "event_id": "e1", "session": upd},
        {"type": "session.update", "session": {"turn_detection": None} if beta else {"type": "realtime", "audio": {"input": {"turn_detection": None}}}},
        {"type": "input_audio_buffer.append", "audio": PCM_B64},
        {"type": "input_audio_buffer.commit", "event_id": "e2"},
        {"type": "input_audio_buffer.clear"},
        {"type": "conversation.item.create", "previous_item_id": None, "item": user},
        {"type": "conversation.item.create", "item": audio_item},
        {"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}},
        {"type": "conversation.item.delete", "item_id": "item_missing"},
        {"type": "conversation.item.truncate", "item_id": "item_missing", "content_index": 0, "audio_end_ms": 100},
        {"type": "conversation.item.retrieve", "item_id": "item_missing"},
        {"type": "response.create", "response": resp},
        {"type": "response.cancel", "event_id": "e3"},
    ]


def duplex_seeds() -> list[dict[str, Any]]:
    ga = [s for s in realtime_seeds(False)]
    return ga + [
        {"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "transport": "json", "pacing": "none"}}}},
        {"type": "playback.ack", "response_id": "resp_x", "played_ms": 120},
        {"type": "heartbeat"},
    ]


def duplex_binary_frames(rng: random.Random) -> Mutant:
    r = rng.random()
    if r < 0.3:
        return Mutant(b"\x01" + bytes(rng.randrange(0, 600) * 2), "audio frame (valid)", "binary")
    if r < 0.5:
        return Mutant(b"\x01" + bytes(rng.randrange(1, 600) * 2 + 1), "odd-length audio frame", "binary")
    if r < 0.7:
        return Mutant(bytes([rng.randrange(2, 256)]) + bytes(64), "wrong type byte", "binary")
    if r < 0.8:
        return Mutant(b"", "empty binary frame", "binary")
    return Mutant(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), "random binary frame", "binary")


def world_seeds() -> list[dict[str, Any]]:
    return [
        {"type": "session.update", "event_id": "w1", "session": {"prompt": "a path", "width": 16, "height": 16, "steps": 1, "seed": 3, "image_format": "jpeg"}},
        {"type": "session.update", "session": {"image_format": "png"}},
        {"type": "world.step", "action": [0.1, 0.0, -0.2, 1.0]},
        {"type": "world.cancel"},
        {"type": "world.reset", "prompt": "a beach", "seed": 1},
    ]


def video_seeds() -> list[dict[str, Any]]:
    return [
        {"type": "session.update", "event_id": "v1", "session": {"prompt": "a cat", "width": 16, "height": 16, "steps": 1, "seed": 2,
                                                                 "chunk_frames": 2, "image_format": "jpeg"}},
        {"type": "generation.start", "frames": 2},
        {"type": "prompt_update", "prompt": "a dog"},
        {"type": "generation.cancel"},
    ]


SPEECH = {"model": "tts", "voice": "tara", "input": "Hi.", "response_format": "pcm", "speed": 1.0, "stream_format": "audio", "seed": 1,
          "instructions": "calm"}
CHAT = {"model": "gpt-4o-audio-preview", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 2, "stream": False, "modalities": ["text"], "temperature": 0.8, "top_p": 0.9, "seed": 1}
CHAT_STREAM = {"model": "gpt-4o-audio-preview", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2, "stream": True,
               "stream_options": {"include_usage": True}}
CHAT_AUDIO = {"model": "gpt-4o-audio-preview", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": WAV_B64, "format": "wav"}}]}],
              "max_tokens": 2, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"}, "stream": True}
IMAGE = {"prompt": "a red square", "model": "omni-rt-image", "n": 1, "size": "16x16", "response_format": "b64_json", "output_format": "png",
         "seed": 1, "num_inference_steps": 1, "guidance_scale": 1.0, "negative_prompt": "blue"}
VIDEO = {"prompt": "a cat", "model": "omni-rt-video", "seconds": "1", "size": "16x16", "fps": 2, "seed": 1, "steps": 1}

# values a form field's text may carry that no schema allows
FORM_WEIRD = ("", " ", "1e309", str(10**30), "-1", "NaN", "inf", "4.5", "true", "x" * 5000, "0x10", "１２", "\x00", "1_000")
# content types a client may get wrong
BAD_FORM_TYPES = (
    "multipart/form-data", "multipart/form-data; boundary=", "multipart/form-data; boundary=nope", "multipart/form-data; boundary=\"B",
    "multipart/form-data; boundary=B; charset=bogus", "application/x-www-form-urlencoded; charset=bogus",
    "application/x-www-form-urlencoded; charset=utf-16", "multipart/mixed; boundary=B", "text/plain; charset=\u00ff",
)


def _multipart(fields: list[tuple[str, bytes]], boundary: str = "B") -> bytes:
    out = b""
    for k, v in fields:
        out += f"--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n".encode() + v + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def _urlencoded(fields: list[tuple[str, bytes]]) -> bytes:
    from urllib.parse import quote_from_bytes

    return b"&".join(quote_from_bytes(k.encode()).encode() + b"=" + (quote_from_bytes(v).encode() if i % 2 else v) for i, (k, v) in enumerate(fields))


def mutate_form(rng: random.Random, seed: dict[str, Any]) -> tuple[bytes, str, str]:
    """A form body (multipart or urlencoded) from `seed`'s fields, mutated: a field sent
    twice or dropped, a value no schema allows, bytes that are not UTF-8, a field no one
    knows, a content type without or with a wrong boundary or charset. Returns (body,
    content type, how)."""
    fields = [(k, str(v).encode()) for k, v in seed.items()]
    hows = []
    for _ in range(rng.choice((1, 1, 2))):
        r = rng.random()
        i = rng.randrange(len(fields))
        if r < 0.2:
            fields.append(fields[i])
            hows.append(f"repeat {fields[i][0]}")
        elif r < 0.35:
            hows.append(f"drop {fields.pop(i)[0]}")
            if not fields:
                fields.append(("prompt", b"x"))
        elif r < 0.65:
            v = rng.choice(FORM_WEIRD)
            fields[i] = (fields[i][0], v.encode("utf-8", "surrogatepass"))
            hows.append(f"{fields[i][0]}={v[:20]!r}")
        elif r < 0.8:
            fields[i] = (fields[i][0], rng.choice((b"\xff\xfe", b"a\xc3", b"\xed\xa0\x80")))
            hows.append(f"{fields[i][0]} not UTF-8")
        else:
            k = rng.choice(("top", "zzz", "n", "prompt ", ""))
            fields.append((k, b"1"))
            hows.append(f"unknown field {k!r}")
    if rng.random() < 0.5:
        body, ctype = _multipart(fields), "multipart/form-data; boundary=B"
    else:
        body, ctype = _urlencoded(fields), "application/x-www-form-urlencoded"
    if rng.random() < 0.2:
        ctype = rng.choice(BAD_FORM_TYPES)
        hows.append(f"content-type {ctype!r}")
    return body, ctype, "form: " + "; ".join(hows)


OFFER_SDP = "\r\n".join([
    "v=0", "o=- 4005111874 4005111874 IN IP4 0.0.0.0", "s=-", "t=0 0", "a=group:BUNDLE 0 1", "a=msid-semantic:WMS *",
    "m=audio 38043 UDP/TLS/RTP/SAVPF 96 9 0 8", "c=IN IP4 192.0.2.2", "a=sendrecv",
    "a=extmap:1 urn:ietf:params:rtp-hdrext:sdes:mid", "a=extmap:2 urn:ietf:params:rtp-hdrext:ssrc-audio-level", "a=mid:0",
    "a=msid:e777407e-dc46-4647-8b32-6c8e131e8cc8 7d781fd8-c14c-4614-8a0e-9aeeb4a2eb7f", "a=rtcp:9 IN IP4 0.0.0.0", "a=rtcp-mux",
    "a=ssrc:177253841 cname:602ffbd1-f778-4fc2-8f8d-127691008abc", "a=rtpmap:96 opus/48000/2", "a=rtpmap:9 G722/8000",
    "a=rtpmap:0 PCMU/8000", "a=rtpmap:8 PCMA/8000",
    "a=candidate:f957a2332b1715da3b0ef8ba684454eb 1 udp 2130706431 192.0.2.2 38043 typ host", "a=end-of-candidates",
    "a=ice-ufrag:iNbm", "a=ice-pwd:7qPceBILwt8l6S4VslIr1y",
    "a=fingerprint:sha-256 59:FC:0B:A2:C7:6D:E9:4D:F7:23:F1:56:3E:4A:DE:95:C7:3F:35:AB:15:B1:F0:60:8A:F9:39:B1:96:7E:A4:52",
    "a=setup:actpass", "m=application 60145 UDP/DTLS/SCTP webrtc-datachannel", "c=IN IP4 192.0.2.2", "a=mid:1",
    "a=sctp-port:5000", "a=max-message-size:262144",
    "a=candidate:f957a2332b1715da3b0ef8ba684454eb 1 udp 2130706431 192.0.2.2 60145 typ host", "a=end-of-candidates",
    "a=ice-ufrag:iNbm", "a=ice-pwd:7qPceBILwt8l6S4VslIr1y",
    "a=fingerprint:sha-256 59:FC:0B:A2:C7:6D:E9:4D:F7:23:F1:56:3E:4A:DE:95:C7:3F:35:AB:15:B1:F0:60:8A:F9:39:B1:96:7E:A4:52",
    "a=setup:actpass", "",
])


def mutate_sdp(rng: random.Random, sdp: str = OFFER_SDP) -> tuple[str, str]:
    lines = sdp.split("\r\n")
    hows = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        r = rng.random()
        i = rng.randrange(len(lines))
        if r < 0.25:
            hows.append(f"drop line {lines[i][:30]!r}")
            del lines[i]
        elif r < 0.4:
            lines.insert(i, lines[i])
            hows.append(f"duplicate line {lines[i][:30]!r}")
        elif r < 0.7:
            toks = re.split(r"([ :/=])", lines[i])
            j = rng.randrange(len(toks))
            toks[j] = rng.choice(("", "-1", "0", "99999999999999999999", "x" * 300, "NaN", "\u00e9", "opus", "audio", "inactive", "ïnvalid"))
            hows.append(f"line {i} token {j} -> {toks[j][:20]!r}")
            lines[i] = "".join(toks)
        elif r < 0.8:
            lines.insert(i, rng.choice(("m=video 9 UDP/TLS/RTP/SAVPF 97", "a=rtpmap:96 bogus/1/1", "a=fmtp:96 x", "m=audio 0 RTP/AVP 0",
                                        "a=recvonly", "a=inactive", "a=setup:active", "a=fingerprint:sha-1 00", "a=mid:",
                                        "a=rtpmap:abc opus/48000/2", "a=ssrc:notanumber cname:x", "a=candidate:x")))
            hows.append(f"insert {lines[i][:30]!r}")
        elif r < 0.9:
            cut = rng.randrange(1, len("\r\n".join(lines)))
            return "\r\n".join(lines)[:cut], "; ".join([*hows, f"truncate at {cut}"])
        else:
            lines = [ln.replace("opus", rng.choice(("OPUS", "speex", "opus2", ""))) for ln in lines]
            hows.append("codec renamed")
    return "\r\n".join(lines), "; ".join(hows)


# ---- OpenPI msgpack observations -------------------------------------------------------------


def _arr(data: bytes, dtype: str, shape: list[int]) -> dict[bytes, Any]:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def openpi_seeds() -> list[dict[Any, Any]]:
    import numpy as np

    img = bytes(8 * 8 * 3)
    obs = {
        "observation/exterior_image_1_left": _arr(img, "|u1", [8, 8, 3]),
        "observation/wrist_image_left": _arr(img, "|u1", [8, 8, 3]),
        "observation/joint_position": _arr(np.linspace(-0.5, 0.5, 7).astype("<f8").tobytes(), "<f8", [7]),
        "observation/gripper_position": _arr(np.array([0.3]).astype("<f8").tobytes(), "<f8", [1]),
        "prompt": "pick up the cup",
    }
    nested = {"observation": {k.split("/", 1)[1]: v for k, v in obs.items() if k.startswith("observation/")}, "prompt": "stack"}
    scalar = dict(obs, extra={b"__npgeneric__": True, b"data": 1.5, b"dtype": "<f8"}, lst=[1, 2, 3])
    return [obs, nested, scalar, {"endpoint": "reset", "seed": 7}, {"endpoint": "reset"}]


def _msgpack_weird(rng: random.Random) -> Any:
    import msgpack

    return rng.choice([
        None, True, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 5000, b"", b"\x00" * 7, [], {}, [[[[]]]],
        {"a": 1}, "|O", "<c16", "<U3", "bogus", "<f2", ">f8", "V8", [-1], [2**40, 2**40], [1] * 20, [8, 8, 3, 1], [0], "8,8",
        [1, 1, 3], [1, 8, 3], [3, 1, 1], [2, 1, 3],
        msgpack.ExtType(5, b"xx"), msgpack.Timestamp(1, 0), {1: 2}, {b"k": "v"}, {(1, 2): 3} if False else {2.5: 1},
    ])


def mutate_openpi(rng: random.Random, seeds: list[dict[Any, Any]]) -> Mutant:
    import msgpack

    seed = rng.choice(seeds)
    r = rng.random()
    if r < 0.08:
        deep = b"\x91" * rng.choice((100, 1000, 5000)) + b"\xc0"
        return Mutant(b"\x81\xa1x" + deep, "deep msgpack arrays", "binary")
    if r < 0.12:
        deep = b"\x81\xa1a" * 1000 + b"\xc0"
        return Mutant(deep, "deep msgpack maps", "binary")
    if r < 0.16:
        return Mutant(json.dumps({"endpoint": "reset"}), "a text frame", "text")
    if r < 0.22 and any(isinstance(v, dict) and b"__ndarray__" in v for v in seed.values()):  # a camera of a size no robot sends
        obj = copy.deepcopy(seed)
        key = rng.choice([k for k, v in obj.items() if isinstance(v, dict) and v.get(b"shape") == [8, 8, 3]])
        shape = rng.choice(([1, 1, 3], [1, 8, 3], [8, 1, 3], [2, 2, 3], [3, 1, 1], [3, 3, 3], [1, 4096, 3], [4097, 1, 3]))
        obj[key] = _arr(bytes(shape[0] * shape[1] * shape[2]), "|u1", shape)
        return Mutant(msgpack.packb(obj), f"{key} of shape {shape}", "binary")
    packed = msgpack.packb(seed)
    if r < 0.35:
        data, how = _bytes_mutation(rng, packed)
        return Mutant(data, how, "binary")
    obj = copy.deepcopy(seed)
    hows = []
    for _ in range(rng.choice((1, 1, 2))):
        paths = _paths(obj)
        path = rng.choice(paths[1:] or paths)
        parent = _get(obj, path[:-1]) if path else None
        v = _msgpack_weird(rng)
        if rng.random() < 0.2 and isinstance(parent, dict):
            del parent[path[-1]]
            hows.append(f"drop {path!r}")
        elif rng.random() < 0.1 and isinstance(parent, dict) and isinstance(path[-1], bytes):
            parent[path[-1].decode()] = parent.pop(path[-1])
            hows.append(f"str key {path[-1]!r}")
        else:
            obj = _set(obj, path, v)
            hows.append(f"{path!r:.60}={v!r:.40}")
    try:
        data = msgpack.packb(obj)
    except (TypeError, ValueError, OverflowError):
        data = packed
        hows.append("(unpackable: seed sent)")
    return Mutant(data, "; ".join(hows), "binary")
