"""`GET /v1/models` and `GET /v1/models/{id}`: every model id the served pipelines
answer to (OpenAI's model objects)."""

from __future__ import annotations

import time

from aiohttp import web

from omni_rt.errors import NotFound
from protocols.http import json_response
from protocols.registry import Routes


def add_routes(routes: Routes, model_ids: list[tuple[str, str]]) -> None:
    """`model_ids`: (model id, pipeline) pairs."""
    created = int(time.time())

    def obj(mid: str, pipeline: str) -> dict[str, object]:
        return {"id": mid, "object": "model", "created": created, "owned_by": f"omni-rt:{pipeline}"}

    async def list_models(request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [obj(m, p) for m, p in model_ids]})

    async def get_model(request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        for mid, p in model_ids:
            if mid == model_id:
                return json_response(obj(mid, p))
        raise NotFound(f"The model '{model_id}' does not exist.", param="model", code="model_not_found")

    routes.add("GET", "/v1/models", list_models, "server")
    routes.add("GET", "/v1/models/{model_id}", get_model, "server")
