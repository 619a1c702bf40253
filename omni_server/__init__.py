"""The server application: the composition root (`omni_server.app` builds the aiohttp app
from every layer: the runtime core `omni_rt`, `sessions`, `protocols`, `pipelines`) and
the `omni-rt` command line (`omni_server.cli`). Nothing below imports it."""
