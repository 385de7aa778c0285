"""ServerArgs validation and the native request shapes."""

from __future__ import annotations

import os
import uuid

import pytest
from pydantic import ValidationError

from pyserve.cli import build_parser
from pyserve.config import ServerArgs, ServerArgsError
from pyserve.io_struct import GenerateReqInput, new_rid


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "fp8"}, "--dtype: got 'fp8'; choose one of auto, float32, bfloat16, float16"),
        ({"port": 0}, "--port: got 0; must be in 1..65535"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static: got 1.5; must be in (0, 1]"),
        ({"max_total_tokens": 0}, "--max-total-tokens: got 0; must be a positive number of tokens"),
        ({"context_length": -5}, "--context-length: got -5; must be a positive number of tokens"),
        ({"max_running_requests": 0}, "--max-running-requests: got 0; must be >= 1"),
        (
            {"attention_backend": "flashinfer"},
            "--attention-backend: got 'flashinfer'; choose one of auto, torch_native, cpu, triton",
        ),
        ({"max_queued_requests": -1}, "--max-queued-requests: got -1; must be >= 0"),
        ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs: got 0; must be >= 1"),
        ({"cuda_graph_bs": [4, 0]}, "--cuda-graph-bs: got [4, 0]; must be batch sizes >= 1"),
    ],
)
def test_server_args_validation(kwargs, message):
    with pytest.raises(ServerArgsError) as exc:
        ServerArgs(**kwargs)
    assert str(exc.value) == message


def test_cli_uses_sglang_flag_names():
    ns = build_parser().parse_args(
        [
            "serve",
            "--model-path",
            "m",
            "--max-total-tokens",
            "100",
            "--disable-radix-cache",
            "--mem-fraction-static",
            "0.5",
            "--random-seed",
            "3",
            "--context-length",
            "64",
            "--attention-backend",
            "torch_native",
        ]
    )
    args = ServerArgs.from_cli_args(ns)
    assert args.attention_backend == "torch_native"
    assert (args.model_path, args.max_total_tokens, args.disable_radix_cache) == ("m", 100, True)
    assert (args.mem_fraction_static, args.random_seed, args.context_length) == (0.5, 3, 64)
    assert (args.host, args.port) == ("127.0.0.1", 30000)


def test_generate_req_split():
    obj = GenerateReqInput(text=["a", "b"], sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}], rid="x")
    reqs = obj.split()
    assert [r.text for r in reqs] == ["a", "b"]
    assert [r.sampling_params.max_new_tokens for r in reqs] == [1, 2]
    assert [r.rid for r in reqs] == ["x-0", "x-1"]
    single = GenerateReqInput(input_ids=[1, 2, 3]).split()
    assert len(single) == 1 and single[0].input_ids == [1, 2, 3] and single[0].sampling_params.max_new_tokens == 128


def test_request_ids_are_random_uuid4_hex_also_across_batches_and_forks():
    rids = [new_rid() for _ in range(600)] + [r.rid for r in GenerateReqInput(text=["a", "b"]).split()]
    assert len(set(rids)) == 602  # 600 spans three 4 KiB batches of randomness
    assert all(len(r) == 32 and r == r.lower() and uuid.UUID(hex=r).version == 4 for r in rids)
    # nothing shared to guess the next id from: no common prefix, no counter
    assert len({r[:8] for r in rids}) > 590
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's next id must not be the parent's next one
        os.write(write, new_rid().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    assert len(child) == 32 and child != new_rid() and child not in rids


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"text": "a", "input_ids": [1]},
        {"text": ["a", "b"], "stream": True},
        {"text": ["a", "b"], "sampling_params": [{}]},
        {"text": "a", "sampling_params": {"top_k": -2}},
        {"text": "a", "sampling_params": {"logit_bias": {"x": 1.0}}},
        {"text": "a", "top_logprobs_num": -1},
        {"text": "a", "sampling_params": {"top_p": 0}},
        {"text": "a", "sampling_params": {"stop": [""]}},
        {"text": "a", "sampling_params": {"unknown": 1}},
    ],
)
def test_generate_req_rejects(body):
    with pytest.raises(ValidationError):
        GenerateReqInput.model_validate(body)


def test_a_folder_named_like_a_gguf_file_is_a_folder(tmp_path):
    from pyserve.model_loader.config import is_gguf_path

    (tmp_path / "m.Q4_1.gguf").mkdir()
    (tmp_path / "f.GGUF").write_bytes(b"GGUF")
    assert not is_gguf_path(str(tmp_path / "m.Q4_1.gguf"))
    assert is_gguf_path(str(tmp_path / "f.GGUF"))
    assert not is_gguf_path(str(tmp_path))
