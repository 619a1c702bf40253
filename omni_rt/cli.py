"""`omni-rt` command line: serve, check a deployment, build tiny checkpoints."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from omni_rt.specs import DeployOverlay, SpecError, load_overlay


def _overlay(args: argparse.Namespace) -> tuple[DeployOverlay, str]:
    overlay = load_overlay(args.deploy)
    source = args.deploy or "deploy overlay"
    server = overlay.server.model_copy(
        update={
            k: v
            for k, v in {
                "host": getattr(args, "host", None),
                "port": getattr(args, "port", None),
                "models_dir": getattr(args, "models_dir", None),
                "log_level": getattr(args, "log_level", None),
            }.items()
            if v is not None
        }
    )
    return overlay.model_copy(update={"server": server}), source


def cmd_serve(args: argparse.Namespace) -> int:
    overlay, source = _overlay(args)
    logging.basicConfig(level=overlay.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from omni_rt.server import create_app

    app = create_app(overlay, source)
    uvicorn.run(app, host=overlay.server.host, port=overlay.server.port, log_level=overlay.server.log_level, lifespan="on")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    overlay, source = _overlay(args)
    from omni_rt.server import create_app

    # Builds (without starting) the whole runtime: model paths, processors, engine args.
    runtime = create_app(overlay, source).state.runtime
    print(json.dumps({name: p.model_dump(mode="json") for name, p in runtime.profiles.items()}, indent=2))
    return 0


def cmd_build_tiny(args: argparse.Namespace) -> int:
    overlay, _ = _overlay(args)
    from omni_rt.server import models_dir
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
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    check = sub.add_parser("check", help="validate a deploy overlay and print the resolved pipelines")
    check.add_argument("--deploy", metavar="FILE")
    check.set_defaults(func=cmd_check)

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
