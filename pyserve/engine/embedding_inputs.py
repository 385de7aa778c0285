"""What an embedding request must hold (`EngineCore.encode`, so `/v1/embeddings`, `/encode` and
`Engine.encode` alike): at least one input, and no input empty.

An empty text is refused, as the OpenAI API refuses `input: ""`, although most tokenizers give
it a few ids (a BOS, or BERT's [CLS] [SEP]): its vector would be that of the special tokens
alone, which no caller means to ask for. The routes check their raw fields first
(`empty_input_problem`, from their pydantic validators), so the message names what is empty
rather than the union branch that failed last.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyserve.errors import InvalidRequestError

_HINT = "an embedding needs at least one character of text or one token id"


def _problem(items: Sequence[Any], single: bool) -> str | None:
    """What is empty among `items` (texts or id lists; other values are left to the type
    checks), or None. single: `items` holds the one input given alone (no index to name)."""
    if len(items) == 0:
        return f"the list is empty; {_HINT}"
    for i, item in enumerate(items):
        if isinstance(item, (str, list, tuple)) and len(item) == 0:
            kind = "text" if isinstance(item, str) else "token-id list"
            return f"the {kind} is empty; {_HINT}" if single else f"item {i} is an empty {kind}; {_HINT}"
    return None


def empty_input_problem(value: Any) -> str | None:
    """What is empty in a request's raw input field (`/v1/embeddings`' `input`, `/encode`'s
    `text` or `input_ids`): one text, one id list, or a list of either; None when nothing is
    (or the value is of another type, which the field's type check refuses)."""
    if isinstance(value, str):
        return _problem([value], single=True)
    if not isinstance(value, list):
        return None
    if value and not any(isinstance(v, (str, list)) for v in value):  # one id list
        return None
    return _problem(value, single=False)


def check_embedding_inputs(inputs: Sequence[str | Sequence[int]]) -> None:
    """Raises InvalidRequestError (400, param "input", the message "input: ...") when
    `inputs` (texts or token-id lists) is empty or holds an empty text or id list; the
    message names the empty item's index when there are several. Any thread."""
    problem = _problem(inputs, single=len(inputs) == 1)
    if problem is not None:
        raise InvalidRequestError(f"input: {problem}", param="input")
