"""`TokenizerServicesMixin`: EngineCore's tokenizer-facing services for the server's routes.

A streamed request's start (tokenize, admit, start with a sink, pause), encoding and
decoding, chat template application, the prompt text (and its token offsets) that `echo`
returns, and the served model's name for a request's `model` field: the routes call these on
the engine, never the tokenizer manager. Called on the loop thread; the
tokenizer work itself runs on the TokenizerManager's executor thread, off the loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from pyserve.engine.incremental_decode import token_deltas
from pyserve.errors import InvalidRequestError
from pyserve.io_struct import GenerateOutput, SingleReq, TokenizedGenerateReq
from pyserve.model_loader.chat_template import BUILTIN_TEMPLATES

if TYPE_CHECKING:
    import numpy as np
    import transformers

    from pyserve.config import ServerArgs
    from pyserve.engine.tokenizer_manager import TokenizerManager


class TokenizerServicesMixin:
    """Tokenizer services over EngineCore's tokenizer; EngineCore sets the attributes below."""

    server_args: ServerArgs
    tokenizer: transformers.PreTrainedTokenizerBase
    tokenizer_manager: TokenizerManager
    model_name: str
    model_path: str  # absolute
    model_path_arg: str  # as given

    def resolve_model(self, requested: str | None) -> str:
        """The served model's name for a request's `model` field, which may be left out or
        name the served model (any of its served names, "default" as SGLang clients send, or
        its path). Raises InvalidRequestError (404, code "model_not_found") for any other model,
        as the OpenAI API and vLLM do."""
        names = (self.model_name, *(self.server_args.served_model_name or ()), "default", self.model_path)
        if requested is None or requested in (*names, self.model_path_arg):
            return self.model_name
        raise InvalidRequestError(
            f"The model `{requested}` does not exist; this server serves `{self.model_name}`.",
            param="model",
            code="model_not_found",
            status=404,
        )

    # ---- a request's start, for the streaming routes (the tokenizer manager's, behind us) ----
    async def tokenize_to_start(self, req: SingleReq) -> TokenizedGenerateReq:
        """`req` tokenized and checked (TokenizerManager.tokenize) and admitted to start
        (`check_can_start`), as a route does before its stream's 200. Raises what those
        raise (InvalidRequestError and its 503 kinds)."""
        tm = self.tokenizer_manager
        treq = await tm.tokenize(req)
        tm.check_can_start(req)
        return treq

    async def check_prompt(self, req: SingleReq) -> None:
        """Raise InvalidRequestError if `req`'s prompt is invalid (what `tokenize` checks)."""
        await self.tokenizer_manager.tokenize(req)

    def start_stream(self, req: SingleReq, treq: TokenizedGenerateReq, sink: Callable[[GenerateOutput], None]) -> None:
        """Start `req` with its outputs handed to `sink` as they come (every chunk when
        req.stream, else the final output; TokenizerManager.start_stream). The caller must
        `forget(rid)` if it stops listening before the final output."""
        self.tokenizer_manager.start_stream(req, treq, sink)

    def pause(self, rid: str, paused: bool) -> None:
        """Its streaming client is behind (True) or caught up: the request's decoding pauses
        meanwhile (Scheduler.pause_request)."""
        self.tokenizer_manager.pause_request(rid, paused)

    async def encode_text(self, text: str, add_special_tokens: bool) -> np.ndarray:
        """`text`'s token ids ([n] int, numpy), tokenized off the loop."""
        return await self.tokenizer_manager.encode(text, add_special_tokens)

    async def decode_ids(self, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """The text of each id sequence, decoded off the loop. Ids must be in the vocabulary."""
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_manager.executor,
            lambda: [cast(str, self.tokenizer.decode(s, skip_special_tokens=skip_special_tokens)) for s in seqs],
        )

    async def _prompt_ids(self, req: SingleReq) -> list[int]:
        if req.input_ids is not None:
            return req.input_ids
        return (await self.tokenizer_manager.encode(req.text or "", req.add_special_tokens)).tolist()

    async def prompt_text(self, req: SingleReq) -> str:
        """The prompt as the tokenizer decodes its ids (special tokens skipped): what `echo`
        returns, so that echo + output text = decode(prompt + output). Call only after the
        request was validated."""
        ids = await self._prompt_ids(req)
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenizer_manager.executor, lambda: cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))
        )

    async def prompt_text_offsets(self, req: SingleReq) -> tuple[str, list[int]]:
        """`prompt_text(req)` and the character offset in it where each prompt token's text
        starts (`text_offset` of echoed prompt logprobs)."""
        ids = await self._prompt_ids(req)

        def work() -> tuple[str, list[int]]:
            text = cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one str
            offsets, at = [], 0
            for delta in token_deltas(self.tokenizer, ids):
                offsets.append(min(at, len(text)))
                at += len(delta)
            return text, offsets

        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_manager.executor, work)

    async def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The prompt text for chat `messages`; `kwargs` go to the tokenizer's
        apply_chat_template (add_generation_prompt defaults to True). Raises
        InvalidRequestError when the model has no chat template or the template rejects
        the messages."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; start the server with --chat-template FILE (or a built-in "
                f"template: {', '.join(BUILTIN_TEMPLATES)})",
                param="messages",
            )
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self.tokenizer_manager.executor,
                lambda: cast(
                    str,
                    self.tokenizer.apply_chat_template(  # tokenize=False: the text
                        messages, tokenize=False, **({"add_generation_prompt": True} | kwargs)
                    ),
                ),
            )
        except Exception as exc:  # jinja errors: the template refused these messages
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc


def default_name(model_path: str) -> str:
    """The served model name when --served-model-name is not given: the path's last part."""
    base = os.path.basename(model_path.rstrip("/"))
    return base.removesuffix(".gguf")
