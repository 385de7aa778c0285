"""`pyserve bench serve`'s flags: SGLang bench_serving's backend names and its random-ids
dataset, the defaults its help shows, and the line naming the defaults a run takes."""

from __future__ import annotations

import argparse
import random

import pytest

from pyserve.bench import datasets as ds
from pyserve.bench.backends import resolve_backend
from pyserve.bench.cli import build_parser, defaults_note, flags_given
from pyserve.cli_parser import subparser


def parse_serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "name, backend",
    [
        ("sglang", "pyserve"),
        ("sglang-native", "pyserve"),
        ("sglang-oai", "openai"),
        ("sglang-oai-chat", "openai-chat"),
        ("vllm", "openai"),
        ("vllm-chat", "openai-chat"),
        ("lmdeploy", "openai"),
        ("lmdeploy-chat", "openai-chat"),
        ("openai-embeddings", "openai-embeddings"),
    ],
)
def test_sglang_backend_names_speak_their_api(name, backend):
    assert parse_serve("--backend", name).backend == name
    assert resolve_backend(name) == backend


def test_unknown_backend_name():
    with pytest.raises(ValueError) as info:
        resolve_backend("trt")
    assert str(info.value).startswith("unknown backend 'trt'; choose one of pyserve, openai, openai-chat, ")


def test_defaults_and_random_ids():
    args = parse_serve("--dataset-name", "random-ids")
    assert (args.dataset_name, args.num_prompts, args.random_input_len, args.random_output_len) == (
        "random-ids",
        50,
        128,
        64,
    )
    assert (args.backend, args.port, args.random_range_ratio) == ("pyserve", 30000, 0.0)


def test_help_shows_the_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # each flag's help on one line
    text = subparser(build_parser(), "serve").format_help()
    assert "requests in the timed run (not generated-shared-prefix) (default: 50)\n" in text
    want = "prompt tokens of random and random-ids (the most, unless --random-range-ratio is 1) (default: 128)\n"
    assert want in text
    assert "the server's port (default: 30000)\n" in text
    assert "no progress bar\n" in text  # a switch: no default shown
    assert "(default: None)" not in text and "(default: False)" not in text


def test_flags_given():
    sub = subparser(build_parser(), "serve")
    argv = ["serve", "--num-prompts", "5", "--random-in=3", "--random", "--disable-tqdm", "--", "--port"]
    # --random-in: one flag's prefix; --random: several's (argparse refuses it); after --: none
    assert flags_given(sub, argv) == {"num_prompts", "random_input_len", "disable_tqdm"}


@pytest.mark.parametrize(
    "argv, note",
    [
        (
            [],
            "50 prompts of 1-128 tokens in, 1-64 out (defaults; change with --num-prompts, --random-input-len, "
            "--random-output-len)",
        ),
        (
            ["--num-prompts", "10", "--random-range-ratio", "1", "--random-output-len", "8"],
            "10 prompts of 128 tokens in, 8 out (default; change with --random-input-len)",
        ),
        (["--random-input-len", "4", "--random-output-len", "8", "--num-prompts", "2"], None),
        (["--dataset-name", "sharegpt"], "50 prompts (default; change with --num-prompts)"),
        (["--dataset-name", "generated-shared-prefix"], None),
    ],
)
def test_defaults_note(argv, note):
    args = parse_serve(*argv)
    assert defaults_note(args, flags_given(subparser(build_parser(), "serve"), argv)) == note


@pytest.fixture(scope="module")
def tok(stories_path):
    from pyserve.model_loader.tokenizer import get_tokenizer

    return get_tokenizer(str(stories_path))


def test_random_ids_rows(tok):
    rows = ds.sample_random_ids(tok, 20, 16, 8, 0.0, seed=3)
    rng = random.Random(3)
    assert [r.prompt_len for r in rows] == ds.lens_in_range(rng, 16, 0.0, 20)
    assert [r.output_len for r in rows] == ds.lens_in_range(rng, 8, 0.0, 20)
    assert rows == ds.sample_random_ids(tok, 20, 16, 8, 0.0, seed=3)
    assert [r.prompt for r in rows] != [r.prompt for r in ds.sample_random_ids(tok, 20, 16, 8, 0.0, seed=4)]
    fixed = ds.sample_random_ids(tok, 3, 5, 2, 1.0, seed=0)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(5, 2)] * 3


def test_build_dataset_dispatches_random_ids(tok):
    args = parse_serve("--dataset-name", "random-ids", "--num-prompts", "4", "--random-input-len", "6")
    assert ds.build_dataset(args, tok) == ds.sample_random_ids(tok, 4, 6, 64, 0.0, seed=1)
