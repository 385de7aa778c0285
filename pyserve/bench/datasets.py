"""Workloads of the bench tool: lists of (prompt, prompt_len, output_len) built from a seed.

* random: prompts of random token ids (special and byte-fallback tokens excluded) decoded to text (then
  re-encoded and cut to length, a few rounds, see _random_text). Lengths use
  SGLang's range convention: input and output lengths are drawn uniformly from the integers
  [max(1, int(len * range_ratio)), len]; range_ratio 1.0 gives exactly len, 0.0 gives 1..len.
  The decoded text is re-encoded and prompt_len is the re-encoded length (decode/encode is not
  always an identity, and the text is what is sent).
* random-ids (SGLang bench_serving's name): as random, but the drawn ids are decoded once and
  prompt_len is the number drawn, without the re-encoding rounds (faster to build; the
  server may count the text a few tokens differently, and its usage says so). SGLang's
  takes consecutive ids from a random offset over the whole vocabulary; these are drawn
  from the regular tokens, as random's are, so no special token lands in a prompt.
* sharegpt: a local JSON file in the ShareGPT layout ([{"conversations": [{"from", "value"},
  ...]}, ...]); the first turn is the prompt, the second turn's token count the output length
  (or --sharegpt-output-len). Pairs with a prompt or reply under 2 tokens, or longer than
  --sharegpt-context-len in total, are skipped. Nothing is downloaded.
* generated-shared-prefix: num_groups groups of prompts_per_group prompts; the prompts of a
  group share one random system prompt of system_prompt_len tokens and end with their own
  random question of question_len tokens (the radix-cache case); shuffled with the seed.
* jsonl: one {"prompt": str, "output_len": int} object a line, used in file order.

Every function raises DatasetError with a message fit for the command line.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


class DatasetError(ValueError):
    """The workload cannot be built (missing file, bad format, bad parameters)."""


@dataclass
class DatasetRow:
    """One request of a workload. prompt_len counts the prompt's tokens (no special tokens)."""

    prompt: str
    prompt_len: int
    output_len: int


def _count(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _regular_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of the vocabulary without special tokens and without byte-fallback tokens
    (`<0x41>`: alone they decode to replacement characters that re-encode longer)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [
        i
        for i, piece in enumerate(pieces)
        if i not in special and not (isinstance(piece, str) and _BYTE_PIECE.match(piece))
    ]


def _random_text(tokenizer: PreTrainedTokenizerBase, rng: random.Random, vocab: list[int], num_tokens: int) -> str:
    """Text of about num_tokens tokens: random ids decoded, re-encoded and cut (or extended)
    to num_tokens, a few rounds, because decoding random ids (byte tokens, merges) and
    re-encoding the text rarely gives back the same count."""
    ids = [rng.choice(vocab) for _ in range(num_tokens)]
    text = ""
    for _ in range(4):
        text = cast(str, tokenizer.decode(ids, skip_special_tokens=True))  # one id list: one str
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == num_tokens:
            break
        ids = ids[:num_tokens] + [rng.choice(vocab) for _ in range(num_tokens - len(ids))]
    return text


def lens_in_range(rng: random.Random, length: int, range_ratio: float, n: int) -> list[int]:
    """n integers uniform in [max(1, int(length * range_ratio)), length]."""
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(n)]


def _random_lengths(
    tokenizer: PreTrainedTokenizerBase, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> tuple[random.Random, list[int], list[tuple[int, int]]]:
    """The random workloads' generator, regular token ids and (input, output) lengths: the same
    seed draws the same lengths for `random` and `random-ids`."""
    rng = random.Random(seed)
    vocab = _regular_token_ids(tokenizer)
    in_lens = lens_in_range(rng, input_len, range_ratio, num_prompts)
    out_lens = lens_in_range(rng, output_len, range_ratio, num_prompts)
    return rng, vocab, list(zip(in_lens, out_lens))


def sample_random(
    tokenizer: PreTrainedTokenizerBase, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[DatasetRow]:
    rng, vocab, lengths = _random_lengths(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    rows = []
    for n_in, n_out in lengths:
        text = _random_text(tokenizer, rng, vocab, n_in)
        rows.append(DatasetRow(text, _count(tokenizer, text), n_out))
    return rows


def sample_random_ids(
    tokenizer: PreTrainedTokenizerBase, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[DatasetRow]:
    """random-ids: rows whose prompt is `prompt_len` random regular token ids decoded once;
    lengths as sample_random draws them (the same seed draws the same lengths)."""
    rng, vocab, lengths = _random_lengths(tokenizer, num_prompts, input_len, output_len, range_ratio, seed)
    rows = []
    for n_in, n_out in lengths:
        ids = [rng.choice(vocab) for _ in range(n_in)]
        rows.append(DatasetRow(cast(str, tokenizer.decode(ids, skip_special_tokens=True)), n_in, n_out))
    return rows


def sample_sharegpt(
    tokenizer: PreTrainedTokenizerBase,
    path: str,
    num_prompts: int,
    seed: int,
    output_len: int | None = None,
    context_len: int | None = None,
) -> list[DatasetRow]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise DatasetError(f"--dataset-path {path!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise DatasetError(f"--dataset-path {path!r}: not a JSON file ({exc})") from exc
    if not isinstance(data, list):
        raise DatasetError(f"--dataset-path {path!r}: expected a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    random.Random(seed).shuffle(pairs)
    rows: list[DatasetRow] = []
    for prompt, reply in pairs:
        if len(rows) == num_prompts:
            break
        prompt_len = _count(tokenizer, prompt)
        out_len = output_len if output_len is not None else _count(tokenizer, reply)
        if prompt_len < 2 or out_len < 2:
            continue
        if context_len is not None and prompt_len + out_len > context_len:
            continue
        rows.append(DatasetRow(prompt, prompt_len, out_len))
    if not rows:
        raise DatasetError(f"--dataset-path {path!r}: no usable conversation")
    return rows


def sample_generated_shared_prefix(
    tokenizer: PreTrainedTokenizerBase,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[DatasetRow]:
    rng = random.Random(seed)
    vocab = _regular_token_ids(tokenizer)
    rows: list[DatasetRow] = []
    for _ in range(num_groups):
        system = _random_text(tokenizer, rng, vocab, system_prompt_len)
        for _ in range(prompts_per_group):
            text = system + "\n" + _random_text(tokenizer, rng, vocab, question_len)
            rows.append(DatasetRow(text, _count(tokenizer, text), output_len))
    rng.shuffle(rows)
    return rows


def load_jsonl(tokenizer: PreTrainedTokenizerBase, path: str, num_prompts: int) -> list[DatasetRow]:
    rows: list[DatasetRow] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if len(rows) == num_prompts:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    prompt, out_len = obj["prompt"], obj["output_len"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DatasetError(
                        f'--dataset-path {path!r} line {line_no}: expected {{"prompt": str, "output_len": int}} ({exc})'
                    ) from exc
                if not isinstance(prompt, str) or not isinstance(out_len, int) or out_len < 1:
                    raise DatasetError(
                        f"--dataset-path {path!r} line {line_no}: prompt must be a "
                        "string and output_len a positive integer"
                    )
                rows.append(DatasetRow(prompt, _count(tokenizer, prompt), out_len))
    except OSError as exc:
        raise DatasetError(f"--dataset-path {path!r}: {exc.strerror}") from exc
    if not rows:
        raise DatasetError(f"--dataset-path {path!r}: no prompt")
    return rows


def build_dataset(args: Any, tokenizer: PreTrainedTokenizerBase) -> list[DatasetRow]:
    """The workload the parsed bench flags (`args`) describe."""
    name = args.dataset_name
    if name in ("sharegpt", "jsonl") and not args.dataset_path:
        raise DatasetError(f"--dataset-name {name} needs --dataset-path FILE")
    if name in ("random", "random-ids"):
        sample = sample_random if name == "random" else sample_random_ids
        return sample(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if name == "sharegpt":
        return sample_sharegpt(
            tokenizer,
            args.dataset_path,
            args.num_prompts,
            args.seed,
            args.sharegpt_output_len,
            args.sharegpt_context_len,
        )
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )
    if name == "jsonl":
        return load_jsonl(tokenizer, args.dataset_path, args.num_prompts)
    raise DatasetError(f"--dataset-name: unknown {name!r}")
