"""Connectors: inproc (zero copy), shm (shared memory across processes)."""

from __future__ import annotations

from omni_rt.connectors.base import Connector, ConnectorError
from omni_rt.connectors.inproc import InprocConnector

BACKENDS = ("inproc", "shm")


def make_connector(backend: str, name: str | None = None) -> Connector:
    if backend == "inproc":
        return InprocConnector(name or backend)
    if backend == "shm":
        from omni_rt.connectors.shm import ShmConnector

        return ShmConnector(name or backend)
    raise ValueError(f"unknown connector backend {backend!r}; known: {', '.join(BACKENDS)}")


__all__ = ["Connector", "ConnectorError", "InprocConnector", "make_connector", "BACKENDS"]
