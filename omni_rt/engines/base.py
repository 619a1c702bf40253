"""What every stage engine offers the stage workers and StagePool."""

from __future__ import annotations

import abc
from typing import Any


class EngineError(RuntimeError):
    pass


class Engine(abc.ABC):
    """One engine per stage replica. Engines never block the event loop."""

    name: str = "engine"

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load weights / spawn processes. Called once before use."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Free everything. Called once at shutdown."""

    @abc.abstractmethod
    def load(self) -> int:
        """Requests currently queued or running (least-queue routing, metrics, tests)."""

    def queue_depth(self) -> int | None:
        """Work items waiting to run (not yet started); None where the engine does not say."""
        return None

    def health(self) -> dict[str, Any]:
        return {"ok": True, "load": self.load()}
