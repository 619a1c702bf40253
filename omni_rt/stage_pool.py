"""StagePool: the replicas of one stage and how requests are placed on them."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping

from omni_rt.engines.base import Engine
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
        return max(self.active, engine_load)


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
    _affinity: "OrderedDict[str, int]" = field(default_factory=OrderedDict)

    def pick(self, affinity: str | None = None) -> Replica:
        if not self.replicas:
            raise RuntimeError(f"stage {self.spec.name} has no replicas")
        if affinity is not None and affinity in self._affinity:
            self._affinity.move_to_end(affinity)
            return self.replicas[self._affinity[affinity]]
        if self.spec.routing == "round_robin":
            replica = self.replicas[next(self._rr) % len(self.replicas)]
        else:
            # least-queue; ties broken round-robin so equal replicas share the work
            start = next(self._rr)
            n = len(self.replicas)
            replica = min((self.replicas[(start + i) % n] for i in range(n)), key=lambda r: r.load())
        if affinity is not None:
            self._affinity[affinity] = replica.index
            while len(self._affinity) > self.max_affinities:
                self._affinity.popitem(last=False)
        return replica

    def release_affinity(self, affinity: str) -> None:
        """Forget a session's pinning (session closed)."""
        self._affinity.pop(affinity, None)

    def load(self) -> int:
        return sum(r.load() for r in self.replicas)

    async def start(self) -> None:
        for r in self.replicas:
            for eng in [r.engine, *r.aux.values()]:
                if eng is not None:
                    await eng.start()
            await r.processor.start()

    async def stop(self) -> None:
        for r in self.replicas:
            for eng in [r.engine, *r.aux.values()]:
                if eng is not None:
                    await eng.stop()
