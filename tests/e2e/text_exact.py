"""Checks that a server's text is exactly the tokenizer's: for greedy outputs, the text of a
continuation equals decode(prompt + output)[len(decode(prompt)):] on /generate, chat and
completions, streamed and not, and `echo` equals decode(prompt). Shared by the stories260k and
SmolLM2 end-to-end tests."""

from __future__ import annotations

import concurrent.futures as cf
import json
from typing import Any

import httpx

# 20 prompts: word boundaries, punctuation, digits, a newline, non-ASCII (byte fallback).
PROMPTS = [
    "Once upon a time,",
    "Once upon a",
    "Lily went to the",
    "Tom said",
    "The sun was",
    "One day, a big bird",
    "She was very happy.",
    "He ran",
    "Mom and Dad",
    "The dog",
    "They played with a ball and",
    "It was a sunny day",
    '"Look!" said Ben',
    "A little girl",
    "The tree had 3",
    "Once upon a time\nthere",
    "Tim saw a café",
    "Sue liked the ☃",
    "The cat and the",
    "In the big park,",
]


def expected_continuation(tok: Any, prompt_ids: list[int], output_ids: list[int]) -> str:
    prompt = tok.decode(prompt_ids, skip_special_tokens=True)
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=True)
    assert full.startswith(prompt), (prompt, full)
    return full[len(prompt) :]


def _sse(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _generate_ids(base: str, ids: list[int], max_new: int) -> list[int]:
    r = httpx.post(
        base + "/generate",
        timeout=300,
        json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}},
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def check_prompt(base: str, tok: Any, prompt: str, max_new: int, chat: bool) -> None:
    """All six ways (native / completions / chat, streamed or not) give the exact text."""
    ids = tok.encode(prompt)
    out_ids = _generate_ids(base, ids, max_new)
    want = expected_continuation(tok, ids, out_ids)
    greedy = {"temperature": 0}
    r = httpx.post(
        base + "/generate", timeout=300, json={"text": prompt, "sampling_params": {**greedy, "max_new_tokens": max_new}}
    )
    assert r.json()["text"] == want and r.json()["output_ids"] == out_ids, prompt
    events = _sse(
        base + "/generate", {"text": prompt, "stream": True, "sampling_params": {**greedy, "max_new_tokens": max_new}}
    )
    assert events[-1]["text"] == want, prompt
    assert all(want.startswith(e["text"]) for e in events), prompt
    body = {"prompt": prompt, "max_tokens": max_new, **greedy}
    r = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert r.json()["choices"][0]["text"] == want, prompt
    r = httpx.post(base + "/v1/completions", json={**body, "echo": True}, timeout=300)
    assert r.json()["choices"][0]["text"] == tok.decode(ids, skip_special_tokens=True) + want, prompt
    chunks = _sse(base + "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want, prompt
    if not chat:
        return
    messages = [{"role": "user", "content": prompt}]
    chat_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.encode(chat_prompt, add_special_tokens=False)
    chat_want = expected_continuation(tok, chat_ids, _generate_ids(base, chat_ids, max_new))
    body = {"messages": messages, "max_tokens": max_new, **greedy}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert r.json()["choices"][0]["message"]["content"] == chat_want, prompt
    chunks = _sse(base + "/v1/chat/completions", {**body, "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == chat_want, prompt


def check_all(base: str, tok: Any, max_new: int, chat: bool = True, workers: int = 4) -> None:
    with cf.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: check_prompt(base, tok, p, max_new, chat), PROMPTS))
