"""Connectors: inproc (zero copy, the stages of one server), ray (Ray's object store:
stages placed in Ray actors, on this node or another)."""

from __future__ import annotations

from omni_rt.connectors.base import Connector, ConnectorError
from omni_rt.connectors.inproc import InprocConnector

BACKENDS = ("inproc", "ray")


def make_connector(backend: str, name: str | None = None) -> Connector:
    if backend == "inproc":
        return InprocConnector(name or backend)
    if backend == "ray":
        from omni_rt.connectors.ray import RayConnector

        return RayConnector(name or backend)
    raise ValueError(f"unknown connector backend {backend!r}; known: {', '.join(BACKENDS)}")


__all__ = ["Connector", "ConnectorError", "InprocConnector", "make_connector", "BACKENDS"]
