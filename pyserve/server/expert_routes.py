"""SGLang's expert distribution record of a mixture-of-experts model: how many tokens each
MoE layer routed to each expert, the input of expert-parallel load balancing (EPLB).

POST /start_expert_distribution_record (counting from zero), POST
/stop_expert_distribution_record, POST /dump_expert_distribution_record ->
{"logical_count": [[tokens per expert] per sparse layer], "layers": [their decoder layer
indices], "recording": bool}. A dense model answers 400. The always-on totals are /metrics'
`pyserve:moe_expert_tokens_total`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.server.context import engine_of
from pyserve.server.render import SafeJSONResponse


async def start_record(request: Request) -> Response:
    engine_of(request).start_expert_distribution_record()
    return SafeJSONResponse({"success": True})


async def stop_record(request: Request) -> Response:
    engine_of(request).stop_expert_distribution_record()
    return SafeJSONResponse({"success": True})


async def dump_record(request: Request) -> Response:
    return SafeJSONResponse(engine_of(request).dump_expert_distribution_record())


ROUTES = [
    Route("/start_expert_distribution_record", start_record, methods=["POST"]),
    Route("/stop_expert_distribution_record", stop_record, methods=["POST"]),
    Route("/dump_expert_distribution_record", dump_record, methods=["POST"]),
]
