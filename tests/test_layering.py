"""The layering of docs/design.md, read from the source: the runtime core imports
nothing above it (only the composition root, omni_rt/server.py and omni_rt/cli.py,
builds the app from every layer), and sessions, protocols and pipelines import neither
the test harness nor the benches."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"omni_rt/server.py", "omni_rt/cli.py"}


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


def test_the_core_imports_nothing_above_it() -> None:
    above = {"sessions", "protocols", "pipelines", "clients", "latency_bench", "testkit", "tests"}
    bad = {m: sorted(n & above) for m, n in imports("omni_rt").items() if m not in ROOTS and n & above}
    assert not bad, bad
    assert imports("omni_rt")["omni_rt/server.py"] & {"protocols", "sessions"}  # the check sees real imports


def test_no_layer_imports_the_harness_or_the_benches() -> None:
    for package in ("sessions", "protocols", "pipelines", "clients"):
        bad = {m: sorted(n & {"testkit", "latency_bench", "tests"}) for m, n in imports(package).items() if n & {"testkit", "latency_bench", "tests"}}
        assert not bad, (package, bad)
