"""omni-rt's in-process test harness (in the spirit of pipecat's `run_test` and
LiveKit's fakes with virtual time): scripted fake engines with the real engines'
contracts, fake stage processors, a fake voice-activity detector, a runtime built
from the real pipeline YAML with the fakes swapped in, a session manager on a clock
the test moves, and the real aiohttp app served in-process (`serve`).

    from testkit import serve

    async with serve(["voice"]) as h:
        ws = await h.client.ws_connect("/v1/realtime")
"""

from omni_rt.engines.fake import FakeArEngine, FakeDiffusionEngine, FakeStepEngine
from testkit.clock import FakeClock
from testkit.server import FAKES, FakeRuntime, Harness, Speeds, serve
from testkit.vad import EnergyVad, energy_vad

__all__ = [
    "FAKES",
    "EnergyVad",
    "FakeArEngine",
    "FakeClock",
    "FakeDiffusionEngine",
    "FakeRuntime",
    "FakeStepEngine",
    "Harness",
    "Speeds",
    "energy_vad",
    "serve",
]
