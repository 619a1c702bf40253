"""Builds and owns the running pieces: connectors, engines, stage pools, orchestrator."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from omni_rt.connectors import Connector, make_connector
from omni_rt.engines.base import Engine
from omni_rt.errors import StageError
from omni_rt.orchestrator import Orchestrator
from omni_rt.specs import AuxEngineSpec, ConnectorSpec, ProfileSpec, SpecError, StageSpec
from omni_rt.stage import StageProcessor
from omni_rt.stage_pool import Replica, StagePool

log = logging.getLogger("omni_rt.runtime")

# (model, config key) -> local directory; raises SpecError naming the key.
ModelResolver = Callable[[str, str], str]


def import_processor(path: str) -> type[StageProcessor]:
    module, _, cls = path.partition(":")
    try:
        obj = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise SpecError(f"processor {path!r} cannot be imported: {exc}") from None
    if not (isinstance(obj, type) and issubclass(obj, StageProcessor)):
        raise SpecError(f"processor {path!r} is not a StageProcessor")
    return obj


_TORCH_ARGS = {"max_batch", "max_wait_ms", "threads", "device", "dtype"}
_DIFFUSERS_ARGS = {"max_batch", "threads", "device", "dtype", "max_sequence_length", "cache", "prompt_cache"}


def build_engine(
    kind: str, model: str | None, engine_args: Mapping[str, Any], processor: type[StageProcessor], role: str, name: str
) -> Engine:
    if kind == "vllm":
        from omni_rt.engines.vllm import VllmEngine

        if model is None:
            raise SpecError(f"stage {name}: a vllm engine needs a model")
        return VllmEngine(model, dict(engine_args), name=name)
    if kind == "torch":
        bad = set(engine_args) - _TORCH_ARGS
        if bad:
            raise SpecError(f"stage {name}: unknown torch engine_args {sorted(bad)}; known: {sorted(_TORCH_ARGS)}")
        module = processor.torch_module(model, role) if model is not None else None
        if module is None:
            raise SpecError(f"stage {name}: a torch engine needs a model and a processor with torch_module()")
        from omni_rt.engines.torch_engine import TorchEngine

        return TorchEngine(module, name=name, realtime=processor.REALTIME, **engine_args)
    if kind == "diffusers":
        bad = set(engine_args) - _DIFFUSERS_ARGS
        if bad:
            raise SpecError(f"stage {name}: unknown diffusers engine_args {sorted(bad)}; known: {sorted(_DIFFUSERS_ARGS)}")
        if model is None:
            raise SpecError(f"stage {name}: a diffusers engine needs a model (a diffusers pipeline directory)")
        from omni_rt.engines.diffusers_engine import DiffusersEngine

        return DiffusersEngine(model, name=name, **engine_args)
    if kind == "fake":
        from omni_rt.engines.fake import FakeArEngine

        return FakeArEngine(name=name, **engine_args)
    raise SpecError(f"stage {name}: unknown engine {kind!r}")


class Runtime:
    def __init__(
        self,
        profiles: Mapping[str, ProfileSpec],
        connectors: Mapping[str, ConnectorSpec],
        resolve_model: ModelResolver = lambda model, key: model,
    ) -> None:
        self.profiles = dict(profiles)
        self.connector_specs = dict(connectors)
        self.resolve_model = resolve_model
        self.connectors: dict[str, Connector] = {}
        self.pools: dict[str, StagePool] = {}
        self.orchestrator: Orchestrator | None = None

    def _stage_specs(self) -> dict[str, tuple[str, StageSpec]]:
        """Stages of every served pipeline; a stage name shared by pipelines is one pool."""
        stages: dict[str, tuple[str, StageSpec]] = {}
        for pname, profile in self.profiles.items():
            for s in profile.stages:
                prev = stages.get(s.name)
                if prev is not None and prev[1] != s:
                    raise SpecError(f"pipeline {pname}: stage {s.name!r} is defined differently by pipeline {prev[0]}")
                stages.setdefault(s.name, (pname, s))  # errors name the first pipeline with it
        return stages

    # ---- what a stage is built from (the test harness swaps these for fakes) ----
    def resolve_stage(self, pipeline: str, s: StageSpec) -> StageSpec:
        """The stage with its model paths resolved to local directories."""
        key = f"pipelines.{pipeline}.stages.{s.name}"
        aux = {
            k: AuxEngineSpec(engine=a.engine, model=self.resolve_model(a.model, f"{key}.aux.{k}.model"), engine_args=a.engine_args)
            for k, a in s.aux.items()
        }
        model = self.resolve_model(s.model, f"{key}.model") if s.model else None
        resolved = s.model_copy(update={"model": model, "aux": aux})
        if not s.placement.remote:  # a replica placed elsewhere checks its model where it runs
            self.check_stage(pipeline, resolved)
        return resolved

    def check_stage(self, pipeline: str, spec: StageSpec) -> None:
        """Refuse a model directory the stage's processor cannot load (from its config
        files: `StageProcessor.check_spec`), naming the deploy key."""
        if spec.model is not None:
            try:
                self.processor_class(spec).check_spec(spec)
            except StageError as exc:
                raise SpecError(f"pipelines.{pipeline}.stages.{spec.name}.model: {exc}") from None

    def processor_class(self, spec: StageSpec) -> type[StageProcessor]:
        return import_processor(spec.processor)

    def make_engine(self, spec: StageSpec, role: str, name: str, processor: type[StageProcessor]) -> Engine:
        """The engine of one replica (`role` "main") or of its aux engine `role`."""
        if role == "main":
            return build_engine(spec.engine, spec.model, spec.engine_args, processor, role, name)
        a = spec.aux[role]
        return build_engine(a.engine, a.model, a.engine_args, processor, role, name)

    def build(self) -> None:
        # Only connectors some edge uses are created (plus inproc for client I/O, and
        # the connector of every stage placed outside the server).
        used = {"inproc"} | {e.connector for p in self.profiles.values() for e in p.edges}
        specs = self._stage_specs()
        used |= {s.placement.connector for _, s in specs.values() if s.placement.remote}
        for name in sorted(used):
            cspec = self.connector_specs.get(name)
            self.connectors[name] = make_connector(cspec.backend if cspec else name, name)
        for name, (pipeline, raw) in specs.items():
            spec = self.resolve_stage(pipeline, raw)
            if spec.placement.remote:
                replicas = self.remote_replicas(pipeline, spec)
            else:
                replicas = [self.local_replica(pipeline, spec, i) for i in range(spec.replicas)]
            self.pools[name] = StagePool(spec, replicas)
        self.orchestrator = Orchestrator(self.profiles, self.pools, self.connectors)

    def local_replica(self, pipeline: str, spec: StageSpec, i: int) -> Replica:
        """Replica `i` of a stage, its engines and processor in this process (the
        server's, or the process of the actor it is placed in)."""
        name = spec.name
        proc_cls = self.processor_class(spec)
        rname = f"{name}-{i}" if spec.replicas > 1 else name
        engine = self.make_engine(spec, "main", rname, proc_cls)
        aux = {k: self.make_engine(spec, k, f"{rname}.{k}", proc_cls) for k in spec.aux}
        try:
            processor = proc_cls(spec, engine, aux)
        except SpecError as exc:
            raise SpecError(f"pipelines.{pipeline}.stages.{name}: {exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise SpecError(f"pipelines.{pipeline}.stages.{name}.processor_args: {exc}") from None
        return Replica(i, engine, aux, processor)

    def remote_replicas(self, pipeline: str, spec: StageSpec) -> list[Replica]:
        """The replicas of a stage placed outside the server: each a proxy of a Ray
        actor that builds it with `local_replica` (omni_rt.placement)."""
        from omni_rt.placement import RemoteStage

        backends = {n: c.backend for n, c in self.connector_specs.items()}
        return [Replica(i, None, {}, RemoteStage(pipeline, spec, i, self.connectors, backends, type(self))) for i in range(spec.replicas)]

    async def start(self) -> None:
        if self.orchestrator is None:
            self.build()
        for name, pool in self.pools.items():
            log.info("starting stage %s (%d replica(s), engine %s)", name, len(pool.replicas), pool.spec.engine)
            await pool.start()

    async def stop(self) -> None:
        if self.orchestrator is not None:
            for rid in self.orchestrator.running():
                await self.orchestrator.abort(rid, "shutdown")
        for pool in self.pools.values():
            try:
                await pool.stop()
            except Exception:  # noqa: BLE001 - keep stopping the others
                log.exception("stopping stage %s failed", pool.spec.name)
        for conn in self.connectors.values():
            conn.close()

    def unhealthy_stages(self) -> list[str]:
        """Stages with no live replica: their work is refused with 503."""
        return [name for name, pool in self.pools.items() if not pool.healthy]

    def health(self) -> dict[str, Any]:
        return {
            "stages": {
                name: {
                    "healthy": pool.healthy,
                    "replicas": [
                        {"engine": r.engine.health() if r.engine else None, "active": r.active, "dead": r.dead,
                         **({"remote": remote} if (remote := r.processor.describe_health()) is not None else {})}
                        for r in pool.replicas
                    ],
                }
                for name, pool in self.pools.items()
            },
            "connectors": {name: c.health() for name, c in self.connectors.items()},
        }
