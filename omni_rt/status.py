"""The lifecycle of one orchestrator request (a leaf module: the orchestrator, the
stage side and the client side all read it)."""

from __future__ import annotations

import enum


class RequestStatus(str, enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"
