"""Per-request sampling and logprobs through the whole Engine on stories260k, against HF
transformers on the same weights: logprobs of sampled and prompt tokens, top logprobs,
penalties, logit bias, min_new_tokens, and seeded requests inside busy batches."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from pyserve import Engine

PROMPT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def engine(stories_path):
    eng = Engine(model_path=str(stories_path), max_total_tokens=2048, max_running_requests=16)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(stories_path):
    return transformers.LlamaForCausalLM.from_pretrained(str(stories_path), dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax of HF's logits at every position."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 1.0, "seed": 11, "top_p": 0.9}])
def test_logprobs_equal_hf_log_softmax(engine, hf, params) -> None:
    out = engine.generate(
        PROMPT,
        dict(params, max_new_tokens=12, ignore_eos=True),
        return_logprob=True,
        top_logprobs_num=4,
        logprob_start_len=0,
        token_ids_logprob=[5, 261],
    )
    meta, output_ids = out["meta_info"], out["output_ids"]
    prompt_ids = [e[1] for e in meta["input_token_logprobs"]]
    assert len(prompt_ids) == meta["prompt_tokens"]
    ref = hf_logprobs(hf, prompt_ids + output_ids)
    n = len(prompt_ids)
    assert [e[1] for e in meta["output_token_logprobs"]] == output_ids
    for k, (lp, token, text) in enumerate(meta["output_token_logprobs"]):
        assert text is None and abs(lp - float(ref[n - 1 + k, token])) < 1e-4
        top = meta["output_top_logprobs"][k]
        assert [t for _, t, _ in top] == ref[n - 1 + k].topk(4).indices.tolist()
        assert [v for v, _, _ in top] == sorted((v for v, _, _ in top), reverse=True)
        if params["temperature"] == 0:
            assert top[0][1] == token  # greedy token first
        assert [t for _, t, _ in meta["output_token_ids_logprobs"][k]] == [5, 261]
        assert abs(meta["output_token_ids_logprobs"][k][0][0] - float(ref[n - 1 + k, 5])) < 1e-4
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    for j in range(1, n):
        assert abs(meta["input_token_logprobs"][j][0] - float(ref[j - 1, prompt_ids[j]])) < 1e-4


def test_prompt_logprobs_are_computed_despite_the_prefix_cache(engine) -> None:
    base = {"temperature": 0, "max_new_tokens": 2}
    first = engine.generate(PROMPT, base, return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True)[
        "meta_info"
    ]
    again = engine.generate(PROMPT, base, return_logprob=True, logprob_start_len=3)["meta_info"]
    assert again["cached_tokens"] <= 2  # the cache may not cover the token before index 3
    expected = first["input_token_logprobs"][3:]
    assert [e[1] for e in again["input_token_logprobs"]] == [e[1] for e in expected]
    for got, want in zip(again["input_token_logprobs"], expected):
        assert abs(got[0] - want[0]) < 1e-5  # recomputed, in a differently shaped batch
    assert first["input_token_logprobs"][1][2] == " Once"  # as it reads after other text
    plain = engine.generate(PROMPT, base)["meta_info"]
    assert "output_token_logprobs" not in plain and plain["cached_tokens"] > 0


def test_seeded_request_same_alone_and_in_a_batch_of_8_others(engine) -> None:
    seeded = {"temperature": 0.9, "top_k": 50, "seed": 1234, "max_new_tokens": 24, "ignore_eos": True}
    alone = engine.generate(PROMPT, seeded)["output_ids"]
    others = [
        {"temperature": t, "max_new_tokens": m, "ignore_eos": True, "frequency_penalty": 0.5}
        for t, m in zip([0.0, 1.0, 0.7, 1.5, 0.0, 1.2, 0.3, 1.0], [5, 30, 12, 24, 40, 8, 20, 16])
    ]
    texts = ["Tom", "The dog ran", "Lily", "One day", PROMPT, "Sue had a ball", "A", "The sun"]
    outs = engine.generate(texts[:4] + [PROMPT] + texts[4:], others[:4] + [seeded] + others[4:])
    assert outs[4]["output_ids"] == alone
    other_seed = engine.generate(PROMPT, dict(seeded, seed=99))["output_ids"]
    assert other_seed != alone


def test_penalties_match_a_reference_loop(engine, hf) -> None:
    prompt = "Tom and Tom and Tom and Tom"
    params = {
        "temperature": 0,
        "max_new_tokens": 24,
        "ignore_eos": True,
        "frequency_penalty": 1.5,
        "presence_penalty": 1.0,
        "repetition_penalty": 1.3,
    }
    out = engine.generate(prompt, params, return_logprob=True, logprob_start_len=0)
    ids = [e[1] for e in out["meta_info"]["input_token_logprobs"]]
    prompt_len, ref = len(ids), []
    with torch.no_grad():
        for _ in range(24):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            for t in set(ids):  # CTRL repetition penalty over prompt + output
                logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
            for t in set(ref):
                logits[t] -= 1.5 * ref.count(t) + 1.0
            ref.append(int(logits.argmax()))
            ids.append(ref[-1])
    assert out["output_ids"] == ref
    assert len(ids) == prompt_len + 24
    plain = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    assert plain["output_ids"] != ref  # the penalties changed something


def test_logit_bias_and_min_new_tokens(engine) -> None:
    biased = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4, "logit_bias": {"300": 100.0}})
    assert biased["output_ids"] == [300] * 4
    greedy = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})["output_ids"]
    stop = greedy[0]
    early = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [stop]})
    assert early["output_ids"] == [stop] and early["meta_info"]["finish_reason"]["matched"] == stop
    held = engine.generate(
        PROMPT, {"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [stop], "min_new_tokens": 3}
    )
    assert stop not in held["output_ids"][:3] and len(held["output_ids"]) >= 3


def test_all_tokens_top_k_zero_and_json_safe_inf(engine) -> None:
    out = engine.generate(
        PROMPT,
        {"temperature": 0.8, "top_k": 0, "seed": 1, "max_new_tokens": 3, "logit_bias": {"7": -math.inf}},
        return_logprob=True,
        token_ids_logprob=[7],
    )
    assert len(out["output_ids"]) == 3
    # logprobs are of the raw model distribution; no -inf / NaN ever reaches JSON
    for entry in out["meta_info"]["output_token_ids_logprobs"]:
        assert math.isfinite(entry[0][0])
