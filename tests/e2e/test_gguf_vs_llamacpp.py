"""Greedy agreement on the default model (SmolLM2-135M-Instruct Q4_1 GGUF) between pyserve's
native quantized path (`quantization="auto"`), its dequantized float32 path (`"none"`) and
llama.cpp's own greedy output (llama-cpp-python's `Llama` on the same file, in the client venv:
tests/clients/llamacpp_greedy.py).

32 prompts (plain text and chat-formatted through the GGUF's chat template, 5 to 100 tokens),
tokenized once with pyserve's tokenizer for the GGUF and fed as ids to both engines; 32 new
tokens each, EOS ignored. For each pair (auto vs llama.cpp, none vs llama.cpp, auto vs none):
how many prompts agree on all 32 tokens, and the mean length of the common prefix (printed;
`pytest -s` shows them). Asserted: every output has exactly 32 ids, all inside the vocabulary,
and the quantized path agrees with llama.cpp on at least as many prompts as float32 does."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import REPO, run_client

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
PLAIN = [
    "The capital of France is",
    "At sea level, water boils at",
    "My favourite season is autumn because",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "Here is a recipe for a simple tomato soup. First,",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Photosynthesis is the process by which plants",
    "The three laws of motion, formulated by Isaac Newton, state that",
    "A good night's sleep matters for your health. Doctors recommend that adults",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his daughter. Every morning",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press. Before his invention, books",
    "Climate change refers to long-term shifts in temperatures and weather patterns. Since the "
    "1800s, human activities have been the main driver of climate change, primarily due to the "
    "burning of fossil fuels like coal, oil and gas. The consequences include",
    "To make a paper airplane, take a sheet of paper and fold it in half lengthwise. Unfold it, "
    "then fold the top corners down to the center crease so that the top forms a point. Next,",
    "The human heart has four chambers: two atria and two ventricles. Blood returning from the body "
    "enters the right atrium, passes into the right ventricle and is pumped to the lungs, where it "
    "picks up oxygen. From the lungs, the blood",
    "Learning a new language takes patience. Many people start with common words and phrases, "
    "listen to native speakers, and practise a little every day. After a few months, learners "
    "usually notice that",
    "It was a dark and stormy night; the rain fell in torrents, except at occasional intervals, "
    "when it was checked by a violent gust of wind which swept up the streets. In the old house "
    "on the hill,",
    "Bees are essential pollinators. Without them,",
    "The stock market fell sharply on Monday after investors reacted to news that the central bank "
    "would raise interest rates again. Analysts warned that the coming weeks could bring more "
    "volatility, as companies prepare to report their quarterly earnings and consumers face "
    "higher prices for food, fuel and housing. Shares of technology firms, which had led the rally "
    "earlier in the year, lost the most ground. Economists said "
    "the bank was trying to cool demand without tipping the economy into recession. Meanwhile, in Asia,",
]
CHAT: list[str | list[dict[str, str]]] = [  # one user message, or whole conversations
    "Hi!",
    "What is the capital of Japan?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the ocean.",
    "Explain in one paragraph why the sky is blue.",
    "How do I boil an egg so that the yolk stays soft?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the main differences between a cat and a dog as a pet? Please answer briefly.",
    "Translate into French: The weather is lovely today and we are going to the beach.",
    "I have a job interview tomorrow for a position as a junior accountant at a small company. "
    "What questions should I expect, and how should I prepare tonight?",
    "My garden has tomatoes, basil, zucchini and a lemon tree. Suggest a dinner I could cook "
    "tonight using mostly these ingredients, with short steps.",
    "Tell me a short story about a robot who learns to paint.",
    [
        {"role": "user", "content": "I want to start running. How far should I run in my first week?"},
        {"role": "assistant", "content": "Start with short runs of about two kilometres, three times a week."},
        {"role": "user", "content": "And how fast should I go?"},
    ],
    [
        {"role": "system", "content": "You are a travel guide. Answer in a friendly tone."},
        {"role": "user", "content": "I am visiting Lisbon for two days in spring. What should I see?"},
    ],
]


def prompt_ids(gguf: str) -> list[list[int]]:
    """The 32 prompts as token ids, through pyserve's tokenizer for the GGUF (no BOS added to
    plain text; chat prompts carry the template's own <|im_start|> markers)."""
    from pyserve.model_loader import get_tokenizer

    tok = get_tokenizer(gguf)
    ids = [tok(text, add_special_tokens=False).input_ids for text in PLAIN]
    for chat in CHAT:
        messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids.append(tok(text, add_special_tokens=False).input_ids)
    return ids


def pyserve_greedy(gguf: str, prompts: list[list[int]], quantization: str) -> list[list[int]]:
    """pyserve's greedy ids (one batch, EOS ignored) through an in-process Engine, shut down
    afterwards."""
    from pyserve import Engine

    engine = Engine(model_path=gguf, quantization=quantization, max_total_tokens=8192)
    try:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float, list[int]]:
    """(prompts agreeing on every token, mean common-prefix length, the prefix lengths)."""
    prefixes = [common_prefix(x, y) for x, y in zip(a, b)]
    full = sum(p == MAX_NEW_TOKENS for p in prefixes)
    return full, sum(prefixes) / len(prefixes), prefixes


def test_greedy_agreement_with_llamacpp(client_python, tmp_path) -> None:
    from pyserve.model_loader import ModelConfig, default_model_path

    gguf = default_model_path()
    vocab_size = ModelConfig.from_path(gguf).vocab_size
    prompts = prompt_ids(gguf)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 32 and 5 <= lengths[0] and lengths[-1] <= 100, lengths

    seconds: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    for q in ("auto", "none"):
        start = time.perf_counter()
        outputs[q] = pyserve_greedy(gguf, prompts, q)
        seconds[q] = time.perf_counter() - start

    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    start = time.perf_counter()
    run_client(
        client_python,
        [
            str(REPO / "tests" / "clients" / "llamacpp_greedy.py"),
            gguf,
            str(tmp_path / "prompts.json"),
            str(tmp_path / "llamacpp.json"),
            str(MAX_NEW_TOKENS),
        ],
        tmp_path,
    )
    seconds["llama.cpp"] = time.perf_counter() - start
    ref = json.loads((tmp_path / "llamacpp.json").read_text())
    outputs["llama.cpp"] = ref["output_ids"]
    assert ref["n_vocab"] == vocab_size, (ref["n_vocab"], vocab_size)

    for name, outs in outputs.items():
        assert len(outs) == len(prompts), (name, len(outs))
        assert all(len(o) == MAX_NEW_TOKENS for o in outs), (name, [len(o) for o in outs])
        assert all(0 <= t < vocab_size for o in outs for t in o), name

    pairs = [("auto", "llama.cpp"), ("none", "llama.cpp"), ("auto", "none")]
    results = {pair: agreement(outputs[pair[0]], outputs[pair[1]]) for pair in pairs}
    lines = [
        f"greedy agreement, SmolLM2-135M-Instruct Q4_1, {len(prompts)} prompts ({lengths[0]}-{lengths[-1]} tokens) "
        f"x {MAX_NEW_TOKENS} new tokens (llama-cpp-python {ref['llama_cpp_version']}):"
    ]
    for (a, b), (full, mean, prefixes) in results.items():
        lines.append(
            f"  {a:>4} vs {b:<9}: {full:2d}/{len(prompts)} prompts agree on all tokens, "
            f"mean common prefix {mean:5.2f}/{MAX_NEW_TOKENS}; prefixes {prefixes}"
        )
    lines.append(
        "  wall time: "
        + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
        + f" (load included; llama.cpp's generation alone {ref['seconds']:.1f} s)"
    )
    report = "\n".join(lines)
    print("\n" + report)
    auto_full, none_full = results[("auto", "llama.cpp")][0], results[("none", "llama.cpp")][0]
    assert auto_full >= none_full, report
