"""The layering of docs/design.md, read from the source: the runtime core (`omni_rt`)
imports nothing above it; the media codecs import no layer; sessions, protocols and
pipelines import nothing above themselves (a wire never reaches the pages, the
pipelines never reach the wires or the sessions); only the composition root
(`omni_server`) builds the app from every layer, and nothing but the harness and the
benches imports it; no layer imports the test harness or the benches."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HARNESS = {"testkit", "latency_bench", "tests"}
LAYERS = ("omni_rt", "media", "sessions", "pipelines", "protocols", "ui", "clients", "omni_server")


def imports(package: str) -> dict[str, set[str]]:
    """Top-level packages each module of `package` imports (anywhere in the module)."""
    out: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(REPO))] = names
    return out


# package -> the packages of this repository it must not import
FORBIDDEN = {
    "omni_rt": {"media", "sessions", "protocols", "pipelines", "ui", "clients", "omni_server"} | HARNESS,
    "media": {"omni_rt", "sessions", "protocols", "pipelines", "ui", "clients", "omni_server"} | HARNESS,
    "sessions": {"protocols", "pipelines", "ui", "clients", "omni_server"} | HARNESS,
    "pipelines": {"sessions", "protocols", "ui", "clients", "omni_server"} | HARNESS,
    "protocols": {"ui", "clients", "omni_server"} | HARNESS,
    "ui": {"clients", "omni_server"} | HARNESS,
    "clients": {"omni_rt", "sessions", "protocols", "pipelines", "ui", "omni_server"} | HARNESS,
}


def test_each_layer_imports_only_what_is_below_it() -> None:
    for package, forbidden in FORBIDDEN.items():
        bad = {m: sorted(n & forbidden) for m, n in imports(package).items() if n & forbidden}
        assert not bad, (package, bad)


def test_the_check_sees_real_imports() -> None:
    root = imports("omni_server")["omni_server/app.py"]
    assert {"omni_rt", "sessions", "protocols", "ui"} <= root
    assert "media" in set().union(*imports("protocols").values())
    assert "omni_rt" in set().union(*imports("pipelines").values())
