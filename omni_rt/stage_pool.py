"""StagePool: the replicas of one stage and how requests are placed on them."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from omni_rt.engines.base import Engine
from omni_rt.errors import EngineDead
from omni_rt.specs import StageSpec
from omni_rt.stage import StageProcessor


@dataclass
class Replica:
    index: int
    engine: Engine | None
    aux: Mapping[str, Engine]
    processor: StageProcessor
    active: int = 0  # requests of this stage currently placed here

    def load(self) -> int:
        engine_load = self.engine.load() if self.engine is not None else 0
        return max(self.active, engine_load, self.processor.queue_load())

    def engines(self) -> list[Engine]:
        return [e for e in (self.engine, *self.aux.values()) if e is not None]

    @property
    def dead(self) -> str | None:
        """Why this replica takes no work (one of its engines is gone, or the actor it
        is placed in), or None."""
        return next((f"{e.name}: {e.dead}" for e in self.engines() if e.dead is not None), None) or self.processor.unavailable()


@dataclass
class StagePool:
    """N replica engines of one stage.

    Sticky affinity: requests with the same affinity key (a session id) go to the same
    replica while it exists, so streaming updates and in-stage state stay put. Others
    go round-robin or to the least-loaded replica.
    """

    spec: StageSpec
    replicas: list[Replica]
    max_affinities: int = 100_000
    _rr: itertools.count = field(default_factory=itertools.count)
    _affinity: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def pick(self, affinity: str | None = None) -> Replica:
        """The replica for a request: the session's pinned one while it lives, else by
        the stage's routing among the live ones. EngineDead when none is live."""
        live = [r for r in self.replicas if r.dead is None]
        if not live:
            why = "; ".join(r.dead or "" for r in self.replicas) or "no replicas"
            raise EngineDead(f"stage {self.spec.name} has no live replica ({why}); retry later")
        if affinity is not None and affinity in self._affinity:
            pinned = self.replicas[self._affinity[affinity]]
            if pinned.dead is None:
                self._affinity.move_to_end(affinity)
                return pinned
        if self.spec.routing == "round_robin":
            replica = live[next(self._rr) % len(live)]
        else:
            # least-queue; ties broken round-robin so equal replicas share the work
            start = next(self._rr)
            n = len(live)
            replica = min((live[(start + i) % n] for i in range(n)), key=lambda r: r.load())
        if affinity is not None:
            self._affinity[affinity] = replica.index
            while len(self._affinity) > self.max_affinities:
                self._affinity.popitem(last=False)
        return replica

    def pin(self, affinity: str, replica: Replica) -> None:
        """Pin a session to `replica` (one a wire picked and reserved room on before
        the session's first request)."""
        self._affinity[affinity] = replica.index
        self._affinity.move_to_end(affinity)
        while len(self._affinity) > self.max_affinities:
            self._affinity.popitem(last=False)

    def release_affinity(self, affinity: str) -> None:
        """Forget a session's pinning (session closed)."""
        self._affinity.pop(affinity, None)

    def load(self) -> int:
        return sum(r.load() for r in self.replicas)

    @property
    def healthy(self) -> bool:
        return any(r.dead is None for r in self.replicas)

    async def start(self) -> None:
        for r in self.replicas:
            for eng in r.engines():
                await eng.start()
            await r.processor.start()

    async def stop(self) -> None:
        for r in self.replicas:
            for eng in r.engines():
                await eng.stop()
            await r.processor.stop()
