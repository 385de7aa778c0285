"""`check_tp_size`: refuse a `--tp-size` the model cannot be split by, in one line, before the
ranks start or any weight loads, from the model's config alone (config.json, or a GGUF's
metadata). The rule is `ShardLayout.of`'s, the one the ranks apply when they load."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

from pyserve.distributed.shard import ShardLayout


class TPSizeError(ValueError):
    """`--tp-size` does not split the model; the message is one line naming the sizes that do."""


def _hf_sizes(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):  # the loader reports an unreadable config in its own words
        return None
    return config if isinstance(config, dict) else None


def _gguf_sizes(path: str) -> dict[str, Any] | None:
    # gguf's reader alone, not pyserve.model_loader.gguf_reader's, which imports transformers
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        arch = reader.fields["general.architecture"].contents()
        keys = {
            "num_attention_heads": f"{arch}.attention.head_count",
            "num_key_value_heads": f"{arch}.attention.head_count_kv",
            "intermediate_size": f"{arch}.feed_forward_length",
            "hidden_size": f"{arch}.embedding_length",
        }
        return {name: reader.fields[key].contents() for name, key in keys.items() if key in reader.fields}
    except (OSError, ValueError, KeyError, IndexError):  # a broken file: the loader says so
        return None


def _refusal(config: SimpleNamespace, size: int) -> str | None:
    """ShardLayout.of's objection to splitting `config` `size` ways, or None."""
    try:
        ShardLayout.of(config, 0, size)
    except ValueError as exc:
        return str(exc)
    return None


def check_tp_size(model_path: str, tp_size: int) -> None:
    """Raise TPSizeError when the model at `model_path` (a local HF folder or .gguf file, as
    `check_model_path` accepts) cannot be split `tp_size` ways: its attention heads or its
    MLP intermediate size not divisible by it, or its KV heads neither divisible by it nor a
    divisor of it (the vocabulary is padded, so any size splits it). The message names the
    sizes up to the head count that do split it, e.g. `--tp-size 2 does not divide the
    model's 3 attention heads (sizes that split this model: 1, 3)`.

    Reads config.json, or the GGUF's metadata (not its tensors); a config without the sizes
    (an encoder, a broken file) passes, for the loader to judge. Any thread; no torch.
    """
    if tp_size <= 1:
        return
    sizes = _gguf_sizes(model_path) if os.path.isfile(model_path) else _hf_sizes(model_path)
    keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_size", "head_dim")
    known = {k: sizes[k] for k in keys if sizes and sizes.get(k) is not None}
    if "num_attention_heads" not in known or "intermediate_size" not in known:
        return
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in known.values()):
        return  # sizes that are not counts: the loader says what is wrong with the config
    heads = known["num_attention_heads"]
    config = SimpleNamespace(**{"hidden_size": heads, "vocab_size": 1, **known})  # (sizes the rule ignores)
    problem = _refusal(config, tp_size)
    if problem is None:
        return
    fits = [str(n) for n in range(1, heads + 1) if _refusal(config, n) is None]
    raise TPSizeError(f"{problem} (sizes that split this model: {', '.join(fits)})")
