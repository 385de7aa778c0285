"""The flags people paste from SGLang and vLLM command lines: each alias sets its ServerArgs
field; --served-model-name takes several names; an unknown flag, a bad value and a --tp-size
the model cannot be split by each end in one line with exit status 2, before torch loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from pyserve.cli import build_parser
from pyserve.config import ServerArgs, ServerArgsError
from pyserve.distributed.tp_check import TPSizeError, check_tp_size
from pyserve.model_loader.default_model import default_model_path
from tests.conftest import REPO
from tests.unit.test_cli_startup import run_cli


def serve_args(*argv: str) -> ServerArgs:
    return ServerArgs.from_cli_args(build_parser().parse_args(["serve", *argv]))


@pytest.mark.parametrize(
    "argv, field, value",
    [
        (["--model", "m"], "model_path", "m"),
        (["--max-model-len", "64"], "context_length", 64),
        (["--gpu-memory-utilization", "0.5"], "mem_fraction_static", 0.5),
        (["--seed", "7"], "random_seed", 7),
        (["--tensor-parallel-size", "2"], "tp_size", 2),
        (["--trust-remote-code"], "trust_remote_code", True),
        (["--served-model-name", "a"], "served_model_name", ["a"]),
        (["--served-model-name", "a", "b"], "served_model_name", ["a", "b"]),
        (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "enable_auto_tool_choice", True),
    ],
)
def test_alias_sets_its_field(argv, field, value):
    assert getattr(serve_args(*argv), field) == value


def test_defaults_of_the_new_fields():
    args = serve_args()
    assert (args.served_model_name, args.trust_remote_code, args.enable_auto_tool_choice) == (None, False, False)


def test_served_model_name_as_one_string_is_a_list_of_one():
    assert ServerArgs(served_model_name="stories").served_model_name == ["stories"]
    with pytest.raises(ServerArgsError) as info:
        ServerArgs(served_model_name=["a", ""])
    assert str(info.value) == "--served-model-name: got ['a', '']; must be one or more non-empty names"


def test_bench_offline_keeps_seed_for_the_workload():
    from pyserve.bench.cli import build_parser as bench_parser

    ns = bench_parser().parse_args(["offline", "--seed", "5", "--random-seed", "3", "--max-model-len", "99"])
    assert (ns.seed, ns.random_seed, ns.context_length) == (5, 3, 99)


def run_module(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyserve", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["serve", "--model-pth", "x"],
            "pyserve serve: error: unrecognized argument --model-pth (did you mean --model-path?) "
            "(see pyserve serve --help)",
        ),
        (
            ["serve", "--max-model-length=5"],
            "pyserve serve: error: unrecognized argument --max-model-length (did you mean --max-model-len?) "
            "(see pyserve serve --help)",
        ),
        (
            ["serve", "org/model"],
            "pyserve serve: error: unrecognized argument org/model (this command takes flags only; a model "
            "is given as --model-path org/model) (see pyserve serve --help)",
        ),
        (
            ["serve", "--port", "abc"],
            "pyserve serve: error: argument --port: invalid int value: 'abc' (see pyserve serve --help)",
        ),
        (
            ["serve", "--enable-auto-tool-choice"],
            "pyserve serve: error: --enable-auto-tool-choice needs --tool-call-parser (one of qwen25, qwen, "
            "hermes, llama3, mistral, pythonic) (see pyserve serve --help)",
        ),
        (
            ["bench", "serve", "--num-promts", "5"],
            "pyserve bench serve: error: unrecognized argument --num-promts (did you mean --num-prompts?) "
            "(see pyserve bench serve --help)",
        ),
    ],
)
def test_flag_mistakes_end_in_one_line(argv, message):
    proc = run_module(*argv)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", message + "\n")


def test_trust_remote_code_logs_one_info_line(tmp_path):
    rc, out, err = run_cli("serve", "--trust-remote-code", "--model-path", str(tmp_path / "nope"))
    lines = err.splitlines()
    assert (rc, out, len(lines)) == (2, "torch imported: False\n", 2)
    assert lines[0].endswith(
        "] INFO pyserve: --trust-remote-code changes nothing: pyserve runs no code from model checkpoints"
    )
    assert lines[1] == f"pyserve: error: --model-path {tmp_path / 'nope'}: no such file or folder"


def model_folder(tmp_path, **sizes: int):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "vocab_size": 100, **sizes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_impossible_tp_size_is_refused_before_torch_loads(tmp_path):
    folder = model_folder(tmp_path, num_attention_heads=3, num_key_value_heads=3, intermediate_size=96)
    rc, out, err = run_cli("serve", "--model-path", str(folder), "--tp-size", "2")
    assert (rc, out) == (2, "torch imported: False\n")
    assert err == (
        "pyserve: error: --tp-size 2 does not divide the model's 3 attention heads "
        "(sizes that split this model: 1, 3)\n"
    )


@pytest.mark.parametrize(
    "sizes, tp_size, message",
    [
        (
            {"num_attention_heads": 4, "num_key_value_heads": 3, "intermediate_size": 96},
            2,
            "--tp-size 2 neither divides nor is a multiple of the model's 3 KV heads (sizes that split this model: 1)",
        ),
        (
            {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 6},
            4,
            "--tp-size 4 does not divide the model's intermediate size 6 (sizes that split this model: 1, 2)",
        ),
        (  # 4 and 8 ranks split 2 KV heads: each is replicated
            {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64},
            16,
            "--tp-size 16 does not divide the model's 8 attention heads (sizes that split this model: 1, 2, 4, 8)",
        ),
    ],
)
def test_tp_size_rules(tmp_path, sizes, tp_size, message):
    with pytest.raises(TPSizeError) as info:
        check_tp_size(str(model_folder(tmp_path, **sizes)), tp_size)
    assert str(info.value) == message


def test_tp_sizes_that_split_or_cannot_be_judged_pass(tmp_path, stories_path):
    for size in (1, 2, 4):  # stories260k: 8 heads, 4 KV heads, intermediate size 172
        check_tp_size(str(stories_path), size)
    check_tp_size(str(model_folder(tmp_path, hidden_size=48)), 2)  # no head count: the loader judges
    check_tp_size(str(tmp_path / "missing"), 2)


def test_tp_size_of_a_gguf_from_its_metadata():
    # SmolLM2-135M: 9 attention heads, 3 KV heads, intermediate size 1536
    check_tp_size(default_model_path(), 3)
    with pytest.raises(TPSizeError) as info:
        check_tp_size(default_model_path(), 2)
    assert str(info.value) == (
        "--tp-size 2 does not divide the model's 9 attention heads (sizes that split this model: 1, 3)"
    )


def test_several_served_model_names(stories_path):
    from pyserve.server.app import create_app

    args = ServerArgs(
        model_path=str(stories_path), served_model_name=["first", "second"], max_total_tokens=256, log_level="warning"
    )
    with TestClient(create_app(args)) as client:
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["first", "second"]  # vLLM lists every name
        assert client.get("/v1/models/second").json()["id"] == "second"
        assert client.get("/v1/models/default").json()["id"] == "first"
        assert client.get("/get_server_info").json()["served_model_name"] == "first"  # SGLang's one name
        for name in ("first", "second"):
            r = client.post("/v1/completions", json={"model": name, "prompt": "Once", "max_tokens": 1})
            assert (r.status_code, r.json()["model"]) == (200, "first")
        r = client.post("/v1/completions", json={"model": "third", "prompt": "Once", "max_tokens": 1})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
