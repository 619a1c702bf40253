"""CLI: ``python -m latency_bench {tts,connectors,sessions,realtime,duplex,text-overhead,openpi,image,world,video-edit,fuzz,shapes,...} ...``."""

from __future__ import annotations

import argparse
import importlib
import sys


def _server_target(p: argparse.ArgumentParser, url: str, port: int) -> None:
    """The arguments of a bench that runs against a server it starts (or one at --url)."""
    p.add_argument("--url", help=f"{url} of a running server (default: start one)")
    p.add_argument("--api-key")
    p.add_argument("--port", type=int, default=port, help=f"port of the server the bench starts (default {port})")
    p.add_argument("--deploy", help="deploy overlay for the server the bench starts")
    p.add_argument("--json", help="write results here (JSON)")


def build_parser() -> argparse.ArgumentParser:
    from latency_bench.connectors import BACKENDS, DEFAULT_SIZES
    from latency_bench.tts import DEFAULT_TEXT, DEFAULT_VARIANTS

    ap = argparse.ArgumentParser(prog="python -m latency_bench", description="omni-rt latency benches")
    sub = ap.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser(
        "tts",
        help="closed-loop /v1/audio/speech bench",
        description="Closed loop: for each concurrency C keep C requests in flight until N have been issued "
        "and completed. Either against a running server (--url) or against servers started per deploy "
        "variant (--compare).",
    )
    target = t.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--compare", action="store_true",
                        help="start a server per variant (one after another), bench each, compare")
    t.add_argument("--concurrency", "-c", default="1,8,32", help="comma-separated levels (default 1,8,32)")
    t.add_argument("--requests", "-n", type=int, default=None,
                   help="requests per level (default max(2*C, 16) for each C)")
    t.add_argument("--warmup", type=int, default=2,
                   help="uncounted sequential warm-up requests before the first level (default 2)")
    t.add_argument("--text", default=DEFAULT_TEXT, help="input text of every request")
    t.add_argument("--voice", default="tara")
    t.add_argument("--format", default="pcm", help="response_format: pcm (default), wav, mp3, ...")
    t.add_argument("--stream-format", default="audio", choices=("audio", "sse"))
    t.add_argument("--speed", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=None, help="seed sent with every request (extension)")
    t.add_argument("--model", default="tts")
    t.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds (default 120)")
    t.add_argument("--json", help="write results here (JSON)")
    c = t.add_argument_group("--compare options")
    c.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated variant names (latency_bench/variants/NAME.yaml) or deploy YAML paths "
                   f"(default {','.join(DEFAULT_VARIANTS)})")
    c.add_argument("--host", default="127.0.0.1", help="host the started servers bind (default 127.0.0.1)")
    c.add_argument("--port", type=int, default=8100,
                   help="base port; variant i listens on port+i (default 8100)")
    c.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds to wait for GET /health == 200 (default 300)")
    c.add_argument("--stop-timeout", type=float, default=20.0,
                   help="seconds after SIGINT before SIGTERM (then SIGKILL) (default 20)")
    c.add_argument("--log-dir", default=None,
                   help="server logs go here (default: server-logs/ next to --json, else bench-out/server-logs)")
    c.add_argument("--engines", action="store_true",
                   help="then drive the first variant's talker and decoder directly in this process (no server) "
                   "at the same levels: the engines' own limit, with audio s/s server / engines and TTFP p99 / p50 targets")
    c.add_argument("--server-cmd", default=None,
                   help="custom server command template with {python} {host} {port} {deploy} placeholders "
                   "(default: {python} -m omni_server.cli serve --host {host} --port {port} --deploy {deploy})")

    sc = sub.add_parser("step-cache", help="diffusers' first-block step cache on the tiny video model: speed-up and output difference")
    sc.add_argument("--model", help="a diffusers pipeline directory (default: the tiny Wan, built if missing)")
    sc.add_argument("--size", type=int, default=128, help="frame side in pixels (default 128)")
    sc.add_argument("--frames", type=int, default=17, help="frames per clip (default 17)")
    sc.add_argument("--steps", type=int, default=30, help="denoising steps (default 30)")
    sc.add_argument("--threshold", type=float, default=0.2, help="FirstBlockCacheConfig threshold (default 0.2)")
    sc.add_argument("--repeat", type=int, default=5, help="timed clips per mode, after one warm-up each (default 5)")
    sc.add_argument("--json", help="write results here (JSON)")

    ds = sub.add_parser("diffusion-steps", help="the diffusers step engine's step and decode time by rows and size, in process")
    ds.add_argument("--model", help="a diffusers pipeline directory (default: the tiny Flux image model, built if missing)")
    ds.add_argument("--sizes", default="64,128,256", help="square frame sides (default 64,128,256)")
    ds.add_argument("--rows", default="1,2,4", help="rows per step (default 1,2,4)")
    ds.add_argument("--repeat", type=int, default=15, help="timed steps per point (default 15)")
    ds.add_argument("--json", help="write results here (JSON)")

    k = sub.add_parser("connectors", help="connector put+get vs memcpy throughput")
    k.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    k.add_argument("--repeat", type=int, default=10, help="timed rounds per size; medians are reported (default 10)")
    k.add_argument("--warmup", type=int, default=2, help="untimed rounds per size (default 2)")
    k.add_argument("--backend", default="ray", choices=BACKENDS,
                   help="connector to compare with memcpy (default ray); inproc is always reported too")
    k.add_argument("--json", help="write results here (JSON)")

    s = sub.add_parser(
        "sessions",
        help="session open+close throughput and admission latency (memory or Redis store)",
        description="C workers loop open -> close on a SessionManager (no pipeline) until N cycles are done.",
    )
    s.add_argument("--store", default="memory", choices=("memory", "redis"))
    s.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    s.add_argument("--concurrency", "-c", default="1,16", help="comma-separated levels (default 1,16)")
    s.add_argument("--cycles", "-n", type=int, default=20000, help="open+close cycles per level (default 20000)")
    s.add_argument("--warmup", type=int, default=200, help="untimed cycles before each level (default 200)")
    s.add_argument("--json", help="write results here (JSON)")

    r = sub.add_parser(
        "realtime",
        help="concurrent /v1/realtime voice sessions: commit -> first audio, E2E, RTF",
        description="S sessions at once, each running --turns manual voice turns.",
    )
    r.add_argument("--sessions", "-s", default="1,8,16", help="comma-separated concurrent session levels (default 1,8,16)")
    r.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    r.add_argument("--warmup", type=int, default=1, help="uncounted turns before the first level (default 1)")
    r.add_argument("--wav", help="utterance to speak (16-bit WAV); default: espeak-ng speech, else noise")
    r.add_argument("--max-output-tokens", type=int, default=24, help="thinker tokens per answer (default 24)")
    r.add_argument("--barge-in", type=int, default=0, metavar="N", help="also run N barge-in trials (server VAD; default 0)")
    r.add_argument("--tools", type=int, default=0, metavar="N",
                   help="also run N forced function calls against N unguided answers: end of speech -> arguments done, guided/unguided per-token cost")
    r.add_argument("--profiles", help="comma-separated voice profiles to compare in one run (e.g. default,omni): a server per profile, "
                                      "one after the other, with only the voice pipeline on")
    _server_target(r, "ws://host:port/v1/realtime", 8200)

    d = sub.add_parser(
        "duplex",
        help="concurrent full-duplex voice sessions over /v1/duplex or WebRTC: reply latency, RTF, pacing, CPU",
        description="S sessions at once, each speaking --turns utterances in real time with server VAD.",
    )
    d.add_argument("--model", help="a full-duplex model instead of the voice pipeline (moshi): S conversations speak --seconds each "
                                   "on /v1/duplex?model=...; step time per 80 ms frame, late frames, admitted, CPU; batched vs one at a time")
    d.add_argument("--seconds", type=float, default=8.0, help="with --model: seconds each conversation speaks (default 8)")
    d.add_argument("--transport", choices=("ws", "webrtc"), default="ws")
    d.add_argument("--pacing", choices=("realtime", "none"), default="realtime",
                   help="WebSocket output pacing (default realtime: frame gaps; none: generation RTF)")
    d.add_argument("--sessions", "-s", default="1,8,16", help="comma-separated concurrent session levels (default 1,8,16)")
    d.add_argument("--turns", type=int, default=2, help="turns per session (default 2)")
    d.add_argument("--wav", help="utterance to speak (16-bit WAV); default: espeak-ng speech, else noise")
    d.add_argument("--max-output-tokens", type=int, default=24, help="thinker tokens per answer (default 24)")
    d.add_argument("--barge-in", type=int, default=0, metavar="N", help="also run N barge-in trials (default 0)")
    d.add_argument("--burner", action="store_true",
                   help="run every level twice: as the machine is, then beside a process spinning one core (started and stopped around it)")
    d.add_argument("--ramp", type=int, default=0, metavar="N",
                   help="rising load instead of levels: offer a new session every --ramp-every seconds up to N (admitted vs refused, stalls)")
    d.add_argument("--ramp-every", type=float, default=3.0, metavar="S", help="seconds between offered sessions with --ramp (default 3)")
    _server_target(d, "http://host:port", 8400)

    cap = sub.add_parser(
        "capacity",
        help="admission against the oracle: the most paced voice sessions that run clean with admission off, then a burst, "
             "a ramp and a slow reader at a fresh server with admission on",
    )
    cap.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    cap.add_argument("--start", type=int, default=2, help="the oracle's first level (default 2)")
    cap.add_argument("--step", type=int, default=2, help="the oracle's step between levels (default 2)")
    cap.add_argument("--max-sessions", type=int, default=24, help="the oracle's last level (default 24)")
    cap.add_argument("--ramp-every", type=float, default=3.0, help="seconds between offered sessions in the ramp (default 3)")
    cap.add_argument("--wav", help="utterance to speak (16-bit WAV); default: espeak-ng speech")
    cap.add_argument("--max-output-tokens", type=int, default=24, help="thinker tokens per answer (default 24)")
    # no --url: the bench starts its own servers (one with admission off, one with it on)
    cap.add_argument("--api-key")
    cap.add_argument("--port", type=int, default=8450, help="port of the servers the bench starts (default 8450)")
    cap.add_argument("--deploy", help="deploy overlay both servers start from")
    cap.add_argument("--json", help="write results here (JSON)")

    o = sub.add_parser(
        "text-overhead",
        help="text-only TTFT through omni-rt vs the same thinker on bare vLLM, same run",
    )
    o.add_argument("--concurrency", "-c", default="1,32", help="comma-separated levels (default 1,32)")
    o.add_argument("--max-tokens", type=int, default=16, help="tokens per request on both sides (default 16)")
    o.add_argument("--warmup", type=int, default=3, help="uncounted requests before the levels, each side (default 3)")
    o.add_argument("--rounds", type=int, default=3, help="rounds per level, alternating which side goes first (default 3)")
    o.add_argument("--per-worker", type=int, default=8, help="counted requests per worker and loop, after an uncounted first wave (default 8)")
    o.add_argument("--open-fraction", type=float, default=0.5,
                   help="open loops are offered this fraction of the slower side's closed-loop throughput (default 0.5)")
    o.add_argument("--http", action="store_true", help="also compare over HTTP: omni-rt's server vs vLLM's OpenAI server")
    o.add_argument("--port", type=int, default=8300, help="port of the --http servers (omni-rt; vLLM on port+1; default 8300)")
    o.add_argument("--json", help="write results here (JSON)")
    p = sub.add_parser(
        "openpi",
        help="robots in lockstep over the OpenPI WebSocket: round trip, server overhead, loop Hz, actions/s",
        description="R robots at once, each calling infer with DROID-shaped observations for --duration seconds; "
        "a no-op openpi-style server is measured in the same run.",
    )
    p.add_argument("--robots", "-r", default="1,4,16", help="comma-separated robot levels (default 1,4,16)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of calls per robot per level (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="uncounted calls per robot before each level (default 3)")
    p.add_argument("--noop-port", type=int, default=8501, help="port of the no-op baseline server (default 8501)")
    _server_target(p, "ws://host:port", 8500)
    im = sub.add_parser(
        "image",
        help="concurrent /v1/images/generations callers: requests/s, latency, step batching",
        description="C callers at once, each sending image requests back to back for --duration seconds.",
    )
    im.add_argument("--concurrency", "-c", default="1,4", help="comma-separated levels (default 1,4)")
    im.add_argument("--duration", type=float, default=10.0, help="seconds per level (default 10)")
    im.add_argument("--warmup", type=int, default=2, help="uncounted requests first (default 2)")
    im.add_argument("--size", help="image size (default: the pipeline's)")
    im.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's)")
    _server_target(im, "http://host:port", 8600)
    tr = sub.add_parser(
        "transcriptions",
        help="concurrent /v1/audio/transcriptions callers: requests/s, latency (asr batching)",
        description="C callers at once, each transcribing the same utterance back to back for --duration seconds.",
    )
    tr.add_argument("--concurrency", "-c", default="1,8", help="comma-separated levels (default 1,8)")
    tr.add_argument("--duration", type=float, default=10.0, help="seconds per level (default 10)")
    tr.add_argument("--warmup", type=int, default=2, help="uncounted requests first (default 2)")
    _server_target(tr, "http://host:port", 8900)
    w = sub.add_parser(
        "world",
        help="concurrent /v1/world rollouts: step latency, frames/s per session",
        description="S world sessions at once, each stepping back to back for --duration seconds.",
    )
    w.add_argument("--sessions", "-s", default="1,4", help="comma-separated levels (default 1,4)")
    w.add_argument("--duration", type=float, default=8.0, help="seconds per level (default 8)")
    w.add_argument("--size", type=int, default=64, help="frame side in pixels (default 64)")
    w.add_argument("--steps", type=int, help="denoising steps per frame (default: the pipeline's)")
    _server_target(w, "ws://host:port/v1/world", 8700)
    v = sub.add_parser("video-edit", help="live video editing: prompt edit -> first frame under the new prompt")
    v.add_argument("--trials", type=int, default=10, help="generations, one edit each (default 10)")
    v.add_argument("--size", type=int, default=64, help="frame side in pixels (default 64)")
    v.add_argument("--steps", type=int, help="denoising steps per frame (default: the pipeline's)")
    v.add_argument("--chunk-frames", type=int, default=4, help="frames per chunk (default 4)")
    v.add_argument("--edit-after", type=int, default=5, help="edit when this frame arrives (default 5)")
    _server_target(v, "ws://host:port/v1/realtime/video", 8800)
    mg = sub.add_parser(
        "migrate",
        help="live migration: drain node A while N duplex listeners are mid-answer; drain time, resume time, the gap heard",
        description="Two servers on one Redis prefix (node A on --port, B on --port+1); per level N listeners on A, A drained, "
        "each resumes on B and asks again.",
    )
    mg.add_argument("--sessions", "-s", default="1,4", help="comma-separated levels (default 1,4)")
    mg.add_argument("--tokens", type=int, default=40, help="answer length in tokens (default 40)")
    mg.add_argument("--timeout", type=float, default=30.0, help="the drain's timeout, seconds (default 30)")
    mg.add_argument("--port", type=int, default=8960, help="node A's port; B takes the next (default 8960)")
    mg.add_argument("--deploy", help="deploy overlay for both nodes (its sessions section is replaced)")
    mg.add_argument("--json", help="write results here (JSON)")
    z = sub.add_parser(
        "fuzz",
        help="seeded mutation fuzzer over every mounted wire: 0 5xx, 0 closes instead of error events, 0 leaked sessions",
        description="Mutated messages (wrong types, huge ints, NaN, lone surrogates, deep nesting, invalid JSON/UTF-8, "
        "byte flips, ...) per protocol against a running server (--url) or the in-process harness (no --url).",
    )
    z.add_argument("--url", help="http://host:port of a running server (default: the in-process harness over fake engines)")
    z.add_argument("--per-protocol", "-n", type=int, default=1000, help="mutated messages per protocol (default 1000)")
    z.add_argument("--seed", type=int, default=0, help="the fuzzer's RNG seed (default 0)")
    z.add_argument("--protocols", help="comma-separated subset (speech,chat,images,videos,webrtc,realtime,realtime-beta,"
                   "duplex,world,video-live,openpi; default: every one the server mounts)")
    z.add_argument("--api-key", help="an admin key (needed to list every session for the leak check when the server has keys)")
    z.add_argument("--timeout", type=float, default=10.0, help="per-message answer timeout, seconds (default 10)")
    z.add_argument("--sequential", action="store_true", help="one protocol after another (default: all at once)")
    z.add_argument("--robot-hz", type=float, default=0.0,
                   help="a control robot (OpenPI) at this rate; its p99 during the run vs before it (default 0: off)")
    z.add_argument("--robot-before", type=float, default=5.0, help="seconds of robot calls before the fuzzing starts (default 5)")
    z.add_argument("--leak-wait", type=float, default=40.0,
                   help="--url: seconds to wait for sessions to end after the run (the disconnect grace; default 40)")
    z.add_argument("--json", help="write results here (JSON)")
    ph = sub.add_parser(
        "telephony",
        help="phone calls over Twilio Media Streams: end of speech -> first μ-law frame, barge-in -> clear",
        description="N calls at once by Twilio-faithful peers, each speaking, hearing the answer in real time and cutting in.",
    )
    ph.add_argument("--calls", default="1,4,8", help="comma-separated concurrent call levels (default 1,4,8)")
    ph.add_argument("--wav", help="utterance to speak (16-bit WAV); default: espeak-ng speech")
    ph.add_argument("--max-output-tokens", type=int, default=48, help="thinker tokens per answer (default 48: long enough to cut in)")
    ph.add_argument("--timeout", type=float, default=60.0, help="seconds a call may wait for each step (default 60)")
    _server_target(ph, "ws://host:port/v1/telephony/twilio", 8600)

    tu = sub.add_parser(
        "turns",
        help="semantic_vad's end-of-turn model vs silence thresholds: false cut-offs and end-of-turn latency",
        description="espeak-ng utterances with mid-sentence pauses fed to silero-vad under semantic_vad, with Smart Turn v3 and without it.",
    )
    tu.add_argument("--eagerness", default="high,medium,low", help="comma-separated eagerness levels (default high,medium,low)")
    tu.add_argument("--turn-model", default="smart-turn-v3", help="smart-turn-v3 (the pipecat-ai wheel's ONNX) or a path to one")
    tu.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1, as the server)")
    tu.add_argument("--json", help="write results here (JSON)")

    lv = sub.add_parser(
        "live",
        help="the Live API beside /v1/realtime and /v1/duplex: end of speech -> first audio (turn-taking), reaction while speaking (full duplex)",
        description="S Live sessions at once on each engine, and as many on the wire that engine also serves, in one run.",
    )
    lv.add_argument("--sessions", "-s", default="1,4,8", help="comma-separated concurrent session levels (default 1,4,8)")
    lv.add_argument("--wav", help="utterance to speak (16-bit 24 kHz WAV); default: espeak-ng speech")
    lv.add_argument("--max-output-tokens", type=int, default=24, help="thinker tokens per answer on /v1/realtime (default 24)")
    lv.add_argument("--seconds", type=float, default=6.0, help="seconds each full-duplex session talks (default 6)")
    lv.add_argument("--timeout", type=float, default=60.0, help="seconds a turn may take (default 60)")
    _server_target(lv, "http://host:port", 8700)

    sh = sub.add_parser(
        "shapes",
        help="every torch/diffusers stage at its public checkpoint's shapes (random weights, in process): step time, batch limits, memory",
        description="Moshi 7B + Mimi, π0, the Qwen2.5-Omni-7B and Qwen3-Omni talkers and codecs, Wan 2.1 1.3B, SkyReels-V2-DF 1.3B "
        "(live video) and the Flux DiT, each built from its configuration with random weights and stepped by the engine the server runs "
        "it in at batch sizes 1..N. --shapes tiny: the tiny checkpoints' configurations (seconds, on a CPU).",
    )
    sh.add_argument("--shapes", choices=("tiny", "real"), default="tiny", help="the tiny checkpoints' shapes (default) or the public checkpoints'")
    sh.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when there is one)")
    sh.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="the stages' dtype (default auto: bfloat16 on a GPU, float32 on a CPU; the codecs stay float32 as the server runs them)")
    sh.add_argument("--families", help="comma-separated subset of moshi,pi0,omni,omni3,wan,skyreels,flux (default: all)")
    sh.add_argument("--batches", help="comma-separated batch sizes for every family (default: per family and shapes)")
    sh.add_argument("--repeat", type=int, default=5, help="timed steps per level, after one warm-up; medians are reported (default 5)")
    sh.add_argument("--budget-s", type=float, default=360.0,
                    help="the whole run's time budget; a family's levels past its share are skipped (default 360: with start-up, within 8 minutes)")
    sh.add_argument("--layers", type=int, help="cut every layer stack to this many (widths kept) and use the tiny sizes: the real shapes' "
                    "code paths on a small machine, not their timings")
    sh.add_argument("--isolate", action="store_true",
                    help="each family in its own process (a GPU fault or a hang ends only that family; each pays its own start-up)")
    sh.add_argument("--json", help="write results here (JSON; rewritten as each family ends)")

    return ap


# subcommand -> module latency_bench.<module>, whose main_<module>(args) runs it
COMMANDS = {"capacity": "capacity", "tts": "tts", "connectors": "connectors", "text-overhead": "text_overhead", "duplex": "duplex", "realtime": "realtime",
            "video-edit": "video_edit", "world": "world", "image": "image", "openpi": "openpi", "sessions": "sessions",
            "fuzz": "fuzz", "transcriptions": "transcriptions", "migrate": "migrate",
            "step-cache": "step_cache", "diffusion-steps": "diffusion_steps", "telephony": "telephony", "turns": "turns", "live": "live", "shapes": "shapes"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "tts":
        if args.requests is not None and args.requests < 1:
            print("error: --requests must be >= 1", file=sys.stderr)
            return 2
        if args.warmup < 0:
            print("error: --warmup must be >= 0", file=sys.stderr)
            return 2
    if args.cmd == "connectors":
        if args.repeat < 1 or args.warmup < 0:
            print("error: --repeat must be >= 1 and --warmup >= 0", file=sys.stderr)
            return 2
    module = COMMANDS.get(args.cmd)
    if module is None:
        return 2
    # each bench is imported only when it runs
    return int(getattr(importlib.import_module(f"latency_bench.{module}"), f"main_{module}")(args))


if __name__ == "__main__":
    sys.exit(main())
