"""Clients nobody here wrote, unchanged, against a real stories260k server: SGLang 0.5.2's
`bench_serving` (backends sglang, sglang-oai, sglang-oai-chat; datasets random-ids and
generated-shared-prefix), an SGLang frontend-language program (`gen`, `select`, multi-turn
chat; tests/clients/sgl_program.py) and lm-eval's `local-completions` on two small local tasks
(log-likelihood and generate_until), whose scores must equal HF transformers' on the same
prompts. The clients run in their own venv (`make client-venv`, tests/clients-requirements.txt)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, run_client, stories_chat_server

POOL = 8192
LM_EVAL_DATA = REPO / "tests" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    yield from stories_chat_server(
        tmp_path_factory, stories_path, "stories-clients", POOL, ["--max-running-requests", "64"]
    )


DATASETS = {
    "random-ids": [
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        "24",
        "--random-input-len",
        "48",
        "--random-output-len",
        "16",
        "--random-range-ratio",
        "0.5",
    ],
    "generated-shared-prefix": [
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "3",
        "--gsp-prompts-per-group",
        "6",
        "--gsp-system-prompt-len",
        "96",
        "--gsp-question-len",
        "16",
        "--gsp-output-len",
        "12",
    ],
}


@pytest.mark.parametrize("dataset", sorted(DATASETS))
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_serving(server, client_python, stories_path, tmp_path, backend, dataset):
    out_file = tmp_path / "result.jsonl"
    proc = run_client(
        client_python,
        [
            "-m",
            "sglang.bench_serving",
            "--backend",
            backend,
            "--base-url",
            server.base_url,
            "--tokenizer",
            str(stories_path),
            *DATASETS[dataset],
            "--max-concurrency",
            "8",
            "--output-file",
            str(out_file),
            "--disable-tqdm",
        ],
        tmp_path,
        timeout_s=300,
    )
    log = proc.stdout + proc.stderr
    result = json.loads(out_file.read_text().splitlines()[-1])
    num = 24 if dataset == "random-ids" else 18
    assert result["completed"] == num, log
    assert f"Successful requests:                     {num}" in log
    assert result["total_output_tokens"] > 0
    assert "Error" not in log and "Traceback" not in log, log


def _generate(server, body: dict) -> dict:
    r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_sgl_function_gen_select_and_chat(server, client_python, tmp_path):
    out = tmp_path / "sgl.json"
    run_client(client_python, [str(REPO / "tests" / "clients" / "sgl_program.py"), server.base_url, str(out)], tmp_path)
    got = json.loads(out.read_text())
    # gen: the greedy continuation up to the stop string, as /generate gives it
    want = _generate(
        server,
        {
            "text": "Once upon a time, Lily and Tom",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": ["."]},
        },
    )
    assert got["cont"] == want["text"] and got["cont"].startswith(" ")
    # select: the frontend scores each choice with /generate's prompt logprobs
    choices = [" park", " moon", " table"]
    prefix = got["story_text"][: len(got["story_text"]) - len(got["place"])]
    prompt_len = _generate(server, {"text": prefix, "sampling_params": {"max_new_tokens": 0}})["meta_info"][
        "prompt_tokens"
    ]
    normalized = []
    for i, choice in enumerate(choices):
        lps = _generate(
            server,
            {
                "text": prefix + choice,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": max(prompt_len - 2, 0),
            },
        )["meta_info"]["input_token_logprobs"]
        values = [e[0] for e in lps if e[0]]
        score = sum(values) / len(values)
        if prefix.endswith(lps[0][2]):  # the frontend's token healing drops that entry
            score = (score * len(lps) - lps[0][0]) / (len(lps) - 1)
            lps = lps[1:]
        assert got["select_meta"]["input_token_logprobs"][i] == lps
        assert got["select_meta"]["normalized_prompt_logprobs"][i] == pytest.approx(score, abs=1e-9)
        normalized.append(score)
    assert got["place"] == choices[max(range(3), key=lambda k: normalized[k])]
    # multi-turn chat: each answer is the greedy continuation of the conversation so far
    text = got["chat_text"]
    marker = "ASSISTANT:"
    first_at = text.index(marker) + len(marker)
    second_at = text.index(marker, first_at) + len(marker)
    for prefix_text, answer in ((text[:first_at], got["chat_first"]), (text[:second_at], got["chat_second"])):
        want = _generate(server, {"text": prefix_text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert answer == want["text"] and answer
    assert [m["role"] for m in got["chat_messages"]] == ["system", "user", "assistant", "user", "assistant"]


def _lm_eval_tasks(folder: Path) -> None:
    common = 'dataset_path: json\ntest_split: test\ntarget_delimiter: ""\n'
    (folder / "mc.yaml").write_text(
        f"task: pyserve_stories_mc\n{common}dataset_kwargs:\n  data_files:\n"
        f"    test: {LM_EVAL_DATA / 'stories_mc.jsonl'}\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "gen.yaml").write_text(
        f"task: pyserve_stories_gen\n{common}dataset_kwargs:\n  data_files:\n"
        f"    test: {LM_EVAL_DATA / 'stories_gen.jsonl'}\noutput_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )


def _hf_expected(stories_path: Path) -> tuple[list[list[float]], float, list[str], float]:
    """HF transformers on the same prompts, tokenized as lm-eval does (BOS added, continuation
    = tokens of context + choice beyond the context's): each choice's log-likelihood, the
    accuracy, each greedy answer (cut at the first '.') and the exact-match rate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    model = AutoModelForCausalLM.from_pretrained(stories_path, torch_dtype=torch.float32).eval()
    mc = [json.loads(line) for line in (LM_EVAL_DATA / "stories_mc.jsonl").read_text().splitlines()]
    gen = [json.loads(line) for line in (LM_EVAL_DATA / "stories_gen.jsonl").read_text().splitlines()]
    lls, correct = [], 0
    with torch.no_grad():
        for doc in mc:
            ctx = tok(doc["context"]).input_ids
            scores = []
            for choice in doc["choices"]:
                whole = tok(doc["context"] + choice).input_ids
                logits = model(torch.tensor([whole])).logits[0].log_softmax(-1)
                scores.append(sum(logits[p - 1, whole[p]].item() for p in range(len(ctx), len(whole))))
            lls.append(scores)
            correct += max(range(len(scores)), key=lambda k: scores[k]) == doc["label"]
        answers, hits = [], 0
        for doc in gen:
            ctx = tok(doc["question"]).input_ids
            out = model.generate(torch.tensor([ctx]), max_new_tokens=12, do_sample=False)[0].tolist()
            full = tok.decode(out, skip_special_tokens=True)
            text = full[len(tok.decode(ctx, skip_special_tokens=True)) :].split(".")[0]
            answers.append(text)
            hits += text == doc["answer"]
    return lls, correct / len(mc), answers, hits / len(gen)


def test_lm_eval_local_completions_equals_hf(server, client_python, stories_path, tmp_path):
    _lm_eval_tasks(tmp_path)
    run_client(
        client_python,
        [
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            f"base_url={server.base_url}/v1/completions,model=stories260k,tokenizer_backend=huggingface,"
            f"tokenizer={stories_path},add_bos_token=True,num_concurrent=4,max_retries=1",
            "--tasks",
            "pyserve_stories_mc,pyserve_stories_gen",
            "--include_path",
            str(tmp_path),
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ],
        tmp_path,
        timeout_s=600,
    )
    results = json.loads(Path(sorted(glob.glob(str(tmp_path / "out" / "*" / "results_*.json")))[-1]).read_text())
    lls, acc, answers, exact = _hf_expected(stories_path)
    assert results["results"]["pyserve_stories_mc"]["acc,none"] == acc
    assert results["results"]["pyserve_stories_gen"]["exact_match,none"] == exact
    assert 0 < exact < 1 and 0 < acc < 1  # the task tells right from wrong
    samples = {}
    for path in glob.glob(str(tmp_path / "out" / "*" / "samples_*.jsonl")):
        task = "mc" if "_mc_" in path else "gen"
        samples[task] = sorted(
            (json.loads(line) for line in Path(path).read_text().splitlines()), key=lambda d: d["doc_id"]
        )
    for doc, want in zip(samples["mc"], lls):
        assert [float(r[0][0]) for r in doc["resps"]] == pytest.approx(want, abs=1e-4)
    assert [doc["filtered_resps"][0] for doc in samples["gen"]] == answers
