"""`omni-rt` command line: serve, check a deployment, build tiny checkpoints."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from collections.abc import Sequence
from typing import Any

from omni_rt.specs import DeployOverlay, SpecError, load_overlay, parse_overlay


def _kv_caps(items: list[str] | None) -> dict[str, int] | None:
    if not items:
        return None
    caps: dict[str, int] = {}
    for item in items:
        kind, sep, n = item.partition("=")
        if not sep or not n.strip().lstrip("-").isdigit():
            raise SpecError(f"command line: --max-sessions-per-kind: expected KIND=N, got {item!r}")
        caps[kind.strip()] = int(n)
    return caps


def _api_keys_file(path: str | None) -> list[dict[str, object]] | None:
    """A YAML list of {key, principal, admin} (the same shape as server.api_keys)."""
    if path is None:
        return None
    import yaml

    try:
        data = yaml.safe_load(open(path, encoding="utf-8"))
    except OSError as exc:
        raise SpecError(f"{path}: cannot read API keys file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    if isinstance(data, dict) and "api_keys" in data:
        data = data["api_keys"]
    if not isinstance(data, list):
        raise SpecError(f"{path}: expected a list of {{key, principal, admin}} entries")
    return data


def _overlay(args: argparse.Namespace) -> tuple[DeployOverlay, str]:
    """The deploy overlay with command-line flags applied on top (flags win)."""
    overlay = load_overlay(args.deploy)
    source = args.deploy or "deploy overlay"
    server_flags = {
        "host": getattr(args, "host", None),
        "port": getattr(args, "port", None),
        "models_dir": getattr(args, "models_dir", None),
        "log_level": getattr(args, "log_level", None),
        "api_key": getattr(args, "api_key", None),
        "ray_address": getattr(args, "ray_address", None),
        "ssl_certfile": getattr(args, "ssl_certfile", None),
        "ssl_keyfile": getattr(args, "ssl_keyfile", None),
    }
    keys = _api_keys_file(getattr(args, "api_keys_file", None))
    session_flags = {
        "max_total": getattr(args, "max_sessions", None),
        "max_per_kind": _kv_caps(getattr(args, "max_sessions_per_kind", None)),
        "max_per_principal": getattr(args, "max_sessions_per_principal", None),
        "idle_ttl_s": getattr(args, "idle_ttl", None),
        "disconnect_grace_s": getattr(args, "disconnect_grace", None),
        "reaper_interval_s": getattr(args, "reaper_interval", None),
        "evict_detached_under_pressure": getattr(args, "evict_detached_under_pressure", None),
        "store": getattr(args, "session_store", None),
        "redis_url": getattr(args, "redis_url", None),
    }
    data = overlay.model_dump(mode="json", exclude_unset=True)
    server = {**data.get("server", {}), **{k: v for k, v in server_flags.items() if v is not None}}
    if keys is not None:
        server["api_keys"] = [*server.get("api_keys", []), *keys]
    sessions = {**data.get("sessions", {}), **{k: v for k, v in session_flags.items() if v is not None}}
    data.update(server=server, sessions=sessions)
    if not args.deploy:
        source = "command line"
    return parse_overlay(data, source), source


def _add_session_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sessions and auth (deploy keys sessions.* and server.api_key(s))")
    g.add_argument("--api-key", help="require this key (admin, principal 'default'): Bearer or Api-Key")
    g.add_argument("--api-keys-file", metavar="FILE", help="YAML list of {key, principal, admin}")
    g.add_argument("--max-sessions", type=int, help="sessions open at once, all kinds (default 256)")
    g.add_argument("--max-sessions-per-kind", action="append", metavar="KIND=N", help="cap for one kind (repeatable)")
    g.add_argument("--max-sessions-per-principal", type=int, help="cap per principal (default none)")
    g.add_argument("--idle-ttl", type=float, metavar="S", help="idle lease of an attached session (default 600)")
    g.add_argument("--disconnect-grace", type=float, metavar="S", help="how long a detached session is resumable (default 30)")
    g.add_argument("--reaper-interval", type=float, metavar="S", help="lease check / renewal period (default 1)")
    g.add_argument(
        "--evict-detached-under-pressure",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="evict the longest-detached session to admit a new one (default off)",
    )
    g.add_argument("--session-store", choices=["memory", "redis"], help="memory (default, one process) or redis")
    g.add_argument("--redis-url", help="Redis for the redis store (default redis://127.0.0.1:6379/0)")


def _warn_leftovers() -> None:
    """Engine processes of an earlier server that are still running hold memory this
    one's engines will need (a GPU's): say so before loading, not after an out-of-
    memory error. (A server's processes end with it; these outlived one.)"""
    from omni_rt.lifeline import leftover_engines

    try:
        found = leftover_engines()
    except Exception as exc:  # noqa: BLE001 - a check, never a reason not to start
        logging.getLogger("omni_server.cli").debug("could not look for leftover engine processes: %s", exc)
        return
    for server, pids in sorted(found.items()):
        print(f"omni-rt: warning: {len(pids)} process(es) of an earlier omni-rt server (pid {server}, no longer running) are still "
              f"alive and hold memory: pids {' '.join(map(str, sorted(pids)))} (stop them: kill {' '.join(map(str, sorted(pids)))})",
              file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> int:
    overlay, source = _overlay(args)
    logging.basicConfig(level=overlay.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from aiohttp import web

    from omni_server.app import create_app, drain_on_sigterm, freeze_startup_objects, runner_options, ssl_context

    tls = ssl_context(overlay.server, source)  # before anything loads: a bad file fails in a second
    _warn_leftovers()
    # Take the port before anything starts: a port in use fails in a second, not after
    # the engines have loaded, and no engine process can take it in the meantime.
    host, port = overlay.server.host, overlay.server.port
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        print(f"omni-rt: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    app = create_app(overlay, source)
    app.on_startup.append(freeze_startup_objects)  # after the engines started (cleanup_ctx runs first)
    app.on_startup.append(drain_on_sigterm(overlay.server.drain_timeout_s))
    options = runner_options(overlay)
    logging.getLogger("omni_server.app").info("serving on %s://%s:%d", "https" if tls else "http", host, port)
    # SIGINT stops the server gracefully (the app's cleanup stops the engines); SIGTERM drains first
    web.run_app(app, sock=sock, print=None, access_log=None, shutdown_timeout=5.0, ssl_context=tls, **options)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    overlay, source = _overlay(args)
    from omni_server.app import RUNTIME, create_app, ssl_context

    ssl_context(overlay.server, source)
    # Builds (without starting) the whole runtime: model paths, processors, engine args.
    runtime = create_app(overlay, source)[RUNTIME]
    print(json.dumps({name: p.model_dump(mode="json") for name, p in runtime.profiles.items()}, indent=2))
    for note in dtype_notes(runtime):
        print(f"omni-rt check: note: {note}", file=sys.stderr)
    for note in admission_notes(overlay):
        print(f"omni-rt check: note: {note}", file=sys.stderr)
    return 0


def admission_notes(overlay: Any) -> list[str]:
    """What load-aware admission will weigh real-time sessions with: the costs the deploy
    states, or that it calibrates at start-up."""
    adm = overlay.sessions.realtime_admission
    if not adm.enabled:
        return ["load-aware admission is off (sessions.realtime_admission.enabled: false): real-time sessions meet only the caps"]
    out = []
    from sessions.admission import Cost

    for name, c in adm.pipeline_costs.items():
        n = Cost(c.base_rtf, max(c.per_session_rtf, adm.min_session_cost_rtf), "deploy").sessions_under(adm.target_rtf)
        out.append(f"admission: pipeline {name} costs {c.base_rtf:.3f} RTF alone, +{c.per_session_rtf:.3f} a session at once "
                   f"(stated in the deploy): a burst of up to {n} is admitted at target {adm.target_rtf:.2f}")
    if adm.calibrate:
        out.append("admission: real-time voice pipelines without a stated cost are calibrated when the server starts "
                   f"(1, {adm.calibrate_sessions}, and up to {adm.calibrate_max_sessions} answers at once; /health shows what was measured)")
    else:
        out.append(f"admission: nothing is calibrated; a pipeline without a stated cost is weighed at the prior {adm.session_cost_rtf:.3f} a session")
    return out


def dtype_notes(runtime: Any) -> list[str]:
    """The real-time torch stages that will not compute in the dtype they were given
    (half precision on a CPU: omni_rt.dtypes), once a stage."""
    from omni_rt.dtypes import planned_dtype_note

    notes: dict[str, str] = {}
    for pipeline, profile in runtime.profiles.items():
        for s in profile.stages:
            if s.engine != "torch" or s.model is None or s.name in notes or not runtime.processor_class(s).REALTIME:
                continue
            model = runtime.resolve_model(s.model, f"pipelines.{pipeline}.stages.{s.name}.model")
            note = planned_dtype_note(s.name, str(s.engine_args.get("device", "cpu")), s.engine_args.get("dtype"), model)
            if note:
                notes[s.name] = note
    return list(notes.values())


def cmd_drain(args: argparse.Namespace) -> int:
    """POST /admin/drain and print the report: exit 0 when every session moved or
    finished, 1 when some did not (they are listed), 2 when the server cannot be asked."""
    import urllib.error
    import urllib.request

    body = json.dumps({} if args.timeout is None else {"timeout_s": args.timeout}).encode()
    req = urllib.request.Request(args.url.rstrip("/") + "/admin/drain", data=body, method="POST", headers={"content-type": "application/json"})
    if args.api_key:
        req.add_header("authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=(args.timeout or 3600) + 30) as resp:
            report = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        print(f"omni-rt drain: {args.url} answered {exc.code}: {detail}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError) as exc:
        print(f"omni-rt drain: cannot reach {args.url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    moved, ended, failed = len(report["moved"]), len(report["ended"]), len(report["failed"])
    print(f"omni-rt drain: node {report['node']}: {moved} moved, {ended} ended, {failed} not moved, {report['remaining']} left, "
          f"in {report['seconds']} s", file=sys.stderr)
    return 0 if not failed and not report["remaining"] else 1


def cmd_build_tiny(args: argparse.Namespace) -> int:
    overlay, _ = _overlay(args)
    from omni_server.app import models_dir
    from pipelines.tiny import build_tiny

    for name, path in build_tiny(models_dir(overlay), force=args.force).items():
        print(f"{name}: {path}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-rt", description="Session-centric realtime server for generative AI.")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the enabled pipelines over HTTP/WebSocket")
    serve.add_argument("--host", help="bind address (default 127.0.0.1; deploy key server.host)")
    serve.add_argument("--port", type=int, help="port (default 8000; deploy key server.port)")
    serve.add_argument("--deploy", metavar="FILE", help="deploy overlay YAML")
    serve.add_argument("--models-dir", help="tiny checkpoint cache (deploy key server.models_dir)")
    serve.add_argument("--ray-address", metavar="ADDR", help="the Ray cluster whose stage actors this front end shares "
                       "(deploy key server.ray_address; default: a Ray instance of its own, started only when a stage is placed "
                       "process or ray)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--ssl-certfile", metavar="FILE", help="serve https/wss with this PEM certificate (deploy key server.ssl_certfile)")
    serve.add_argument("--ssl-keyfile", metavar="FILE", help="its PEM private key, unencrypted (deploy key server.ssl_keyfile)")
    _add_session_flags(serve)
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check", help="validate a deploy overlay and print the resolved pipelines")
    check.add_argument("--deploy", metavar="FILE")
    _add_session_flags(check)
    check.set_defaults(func=cmd_check)

    drain = sub.add_parser("drain", help="move every session off a running server (before a restart); exit 0 once it is empty")
    drain.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    drain.add_argument("--api-key", help="an admin key of that server")
    drain.add_argument("--timeout", type=float, metavar="S", help="how long sessions may take to reach a clean point (default: its server.drain_timeout_s)")
    drain.set_defaults(func=cmd_drain)

    models = sub.add_parser("models", help="model utilities")
    msub = models.add_subparsers(dest="models_command", required=True)
    bt = msub.add_parser("build-tiny", help="build the tiny reference checkpoints (idempotent)")
    bt.add_argument("--deploy", metavar="FILE")
    bt.add_argument("--models-dir")
    bt.add_argument("--force", action="store_true", help="rebuild even if present")
    bt.set_defaults(func=cmd_build_tiny)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SpecError as exc:
        print(f"omni-rt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
