"""The API port's small GET pages, as vLLM serves them: `/v1/models`, `/v1/models/{id}`, `/health`.

A model id may hold slashes (`meta-llama/Llama-3.3-70B-Instruct`): `/v1/models/{id}` takes
the rest of the path, as sent or percent-encoded (the `openai` SDK sends `%2F`). `/health`
answers 200 with an empty body once the gateway has a routing table, 503 before, as vLLM's
does while its engine is not up; `/healthz`, `/readyz` and `/metrics` stay on the operator
listener.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from urllib.parse import unquote

from gearshift.gateway.errors import error_body
from gearshift.gateway.request import Request
from gearshift.gateway.request_checks import shown
from gearshift.gateway.routes import RoutingTable

MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"
PAGES = (MODELS_PATH, MODELS_PATH + "/{id}", HEALTH_PATH)  # as named in the 404 for no route

# (request, the routing table, whether one was loaded)
Page = Callable[[Request, RoutingTable, bool], None]


def find_page(path: str) -> Page | None:
    """The page for `path`, or None."""
    if path == MODELS_PATH:
        return _models
    if path.startswith(MODELS_PATH + "/"):
        return _model
    if path == HEALTH_PATH:
        return _health
    return None


def model_object(model: str) -> dict[str, object]:
    """OpenAI's model object, as in `GET /v1/models` and `GET /v1/models/{id}`."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "gearshift"}


def model_not_found(model: str) -> bytes:
    """The 404 body for a model not in the table (it does not list the models)."""
    return error_body(404, f"The model {shown(model)} does not exist on this gateway; "
                      "GET /v1/models lists the models it serves.", "model_not_found", "model")


def _models(request: Request, table: RoutingTable, _loaded: bool) -> None:
    data = [model_object(m) for m in table.model_names()]
    request.respond(200, json.dumps({"object": "list", "data": data}).encode())


def _model(request: Request, table: RoutingTable, _loaded: bool) -> None:
    raw = request.path[len(MODELS_PATH) + 1:]
    try:
        model = unquote(raw, errors="strict")
    except UnicodeDecodeError:  # percent-encoded bytes that are not UTF-8: no model's name
        model = raw
    if model in table.models:
        request.respond(200, json.dumps(model_object(model)).encode())
    else:
        request.respond(404, model_not_found(model))


def _health(request: Request, _table: RoutingTable, loaded: bool) -> None:
    if loaded:
        request.respond(200, b"", b"")
    else:
        request.respond(503, error_body(503, "The gateway has no routing table yet.",
                                        "no_routing_table"))
