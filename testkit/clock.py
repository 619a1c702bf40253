"""Virtual time for leases: the session manager reads `clock()`, tests move it."""

from __future__ import annotations


class FakeClock:
    """A monotonic clock that only moves when told to (`advance`)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        self.now += seconds
        return self.now
