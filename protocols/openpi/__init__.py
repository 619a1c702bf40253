"""The OpenPI robot policy WebSocket (openpi-client's `WebsocketClientPolicy` works
unchanged): the msgpack-numpy codec (`codec`) and the connection handling (`server`)."""

from protocols.openpi.codec import ProtocolError, flatten, packb, unpackb
from protocols.openpi.server import MAX_OBSERVATION_BYTES, Policy, PolicyConnection, mount

__all__ = ["MAX_OBSERVATION_BYTES", "Policy", "PolicyConnection", "ProtocolError", "flatten", "mount", "packb", "unpackb"]
