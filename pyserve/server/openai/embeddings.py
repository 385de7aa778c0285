"""`/v1/embeddings` (OpenAI's shape, vLLM's rules for `dimensions`) and SGLang's native
`/encode`, over `EngineCore.encode`.

`encoding_format` "base64" (what the `openai` client asks for unless told otherwise) is the
float32 little-endian bytes of each vector in base64, as the OpenAI API sends them.
`dimensions` truncates each vector to its first N values and normalises it again: only for a
Matryoshka model (its config.json says `is_matryoshka` or lists `matryoshka_dimensions`, or
the server runs with `--is-matryoshka`), else a 400, as vLLM answers.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.engine.embedding_inputs import empty_input_problem
from pyserve.engine.engine_core import EngineCore
from pyserve.errors import InvalidRequestError
from pyserve.server.context import engine_of
from pyserve.server.openai.protocol import STRICT
from pyserve.server.render import SafeJSONResponse
from pyserve.server.request_body import parse_json
from pyserve.server.sse import until_disconnect

NonEmptyIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def refuse_empty(value: Any) -> Any:
    """A `mode="before"` field validator: ValueError (a 400 naming the field) for an empty
    text, list or id list, whichever the field's union would have refused with another
    branch's message ("Input should be a valid string" for `[]`), or accepted (`""`)."""
    problem = empty_input_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request: `input` a string, a list of strings, a token-id list or a
    list of token-id lists, none of them empty (as the OpenAI API refuses `""` and `[]`);
    `encoding_format` float or base64; `dimensions` (Matryoshka models only); `user` is
    accepted and not used."""

    model_config = STRICT
    model: str | None = None
    input: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | NonEmptyIds
        | Annotated[list[NonEmptyIds], Field(min_length=1)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None

    _input_not_empty = field_validator("input", mode="before")(refuse_empty)


class EncodeRequest(BaseModel):
    """SGLang's /encode: `text` (a string or a list) or `input_ids` (a list or a list of
    lists), none of them empty, and an optional `rid`."""

    model_config = ConfigDict(extra="forbid")
    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: NonEmptyIds | Annotated[list[NonEmptyIds], Field(min_length=1)] | None = None
    rid: str | None = None

    _inputs_not_empty = field_validator("text", "input_ids", mode="before")(refuse_empty)


def check_dimensions(dimensions: int, engine: EngineCore) -> None:
    """Raises InvalidRequestError (param dimensions) unless the served model takes
    `dimensions` (checked before any input runs): one trained for shorter outputs (its config,
    or --is-matryoshka) and a size it lists, or any up to its hidden size. A model that serves
    no embeddings is refused by `encode` itself."""
    info = engine.embedding_info
    if info is None:
        return
    sizes = list(info.matryoshka_dimensions) if info.matryoshka_dimensions is not None else None
    if not (info.matryoshka or engine.server_args.is_matryoshka):
        raise InvalidRequestError(
            f'Model "{engine.model_name}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results (start the server with --is-matryoshka if it was trained so)",
            param="dimensions",
        )
    if dimensions > info.hidden_size or (sizes is not None and dimensions not in sizes):
        allowed = f"one of {sizes}" if sizes is not None else f"at most {info.hidden_size}"
        raise InvalidRequestError(f"dimensions {dimensions} is not supported: {allowed}", param="dimensions")


def truncate(vectors: np.ndarray, dimensions: int, engine: EngineCore) -> np.ndarray:
    """The first `dimensions` values of each row [N, hidden] (checked by check_dimensions),
    normalised again when the model's pooling normalises."""
    out = vectors[:, :dimensions]
    info = engine.embedding_info
    if info is not None and info.pooling.normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, 1e-12)
    return out


async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings: {"object": "list", "data": [{"object": "embedding", "index",
    "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}."""
    body = EmbeddingRequest.model_validate(await parse_json(request))
    engine = engine_of(request)
    name = engine.resolve_model(body.model)
    if body.dimensions is not None:
        check_dimensions(body.dimensions, engine)
    inputs: Any = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    outs = await until_disconnect(request, engine.encode(inputs))
    vectors = np.stack([cast(np.ndarray, out.embedding) for out in outs]).astype(np.float32, copy=False)
    if body.dimensions is not None:
        vectors = truncate(vectors, body.dimensions, engine).astype(np.float32, copy=False)
    data: list[dict[str, Any]] = []
    for i, row in enumerate(vectors):
        value: Any = (
            base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
            if body.encoding_format == "base64"
            else row.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = sum(out.prompt_tokens for out in outs)
    return SafeJSONResponse(
        {
            "object": "list",
            "data": data,
            "model": name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def encode(request: Request) -> Response:
    """POST /encode: {"embedding": [...], "meta_info": {...}}, a list of them for a list."""
    body = EncodeRequest.model_validate(await parse_json(request))
    engine = engine_of(request)
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError("give either text or input_ids", param="text")
    items: Any = body.text if body.text is not None else body.input_ids
    single = isinstance(items, str) or isinstance(items[0], int)
    outs = await until_disconnect(request, engine.encode([items] if single else items, rid=body.rid))
    dicts = [out.to_native_embedding() for out in outs]
    return SafeJSONResponse(dicts[0] if single else dicts)


ROUTES = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/encode", encode, methods=["POST"]),
]
