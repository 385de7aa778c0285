"""n > 1 on the in-process Engine (stories260k): the prompt is prefilled once and every sample
reuses it, each seeded sample has its own reproducible stream, outputs come prompt-major."""

from __future__ import annotations

import pytest

from pyserve.engine.parallel_sampling import sample_seed
from tests.conftest import make_stories_engine


def test_sample_seeds():
    assert sample_seed(None, 3) is None
    assert sample_seed(42, 0) == 42
    seeds = [sample_seed(42, i) for i in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**64 for s in seeds)
    assert sample_seed(42, 1) == (42 + 0x9E3779B97F4A7C15) % 2**64
    assert sample_seed(-1, 1) == (-1 + 0x9E3779B97F4A7C15) % 2**64


@pytest.fixture(scope="module")
def engine(stories_path):
    eng = make_stories_engine(stories_path, 2048)
    yield eng
    eng.shutdown()


def test_n_samples_share_the_prefilled_prompt(engine):
    sp = {"n": 4, "temperature": 1.0, "seed": 3, "max_new_tokens": 6, "ignore_eos": True}
    outs = engine.generate("Lily and Ben went to the big green", sp)
    assert [o["index"] for o in outs] == [0, 1, 2, 3]
    prompt_tokens = outs[0]["meta_info"]["prompt_tokens"]
    assert all(o["meta_info"]["cached_tokens"] == prompt_tokens - 1 for o in outs)
    assert all(len(o["output_ids"]) == 6 for o in outs)
    # each sample i equals a lone request seeded with sample_seed(3, i)
    for i, o in enumerate(outs):
        lone = engine.generate("Lily and Ben went to the big green", {**sp, "n": 1, "seed": sample_seed(3, i)})
        assert lone["output_ids"] == o["output_ids"]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_n_with_a_batch_is_prompt_major(engine):
    outs = engine.generate(["Tom", "Sue"], {"n": 2, "temperature": 0, "max_new_tokens": 3})
    assert len(outs) == 4 and [o["index"] for o in outs] == [0, 1, 0, 1]
    tom = engine.generate("Tom", {"temperature": 0, "max_new_tokens": 3})
    sue = engine.generate("Sue", {"temperature": 0, "max_new_tokens": 3})
    assert [o["output_ids"] for o in outs] == [tom["output_ids"]] * 2 + [sue["output_ids"]] * 2


def test_n_streamed(engine):
    chunks = list(engine.generate("Once upon a time", {"n": 2, "temperature": 0, "max_new_tokens": 4}, stream=True))
    last = {c["index"]: c for c in chunks}
    assert sorted(last) == [0, 1]
    assert last[0]["output_ids"] == last[1]["output_ids"] and len(last[0]["output_ids"]) == 4
    assert all(last[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 4} for i in (0, 1))


def test_abort_while_the_shared_prompt_is_prefilled(stories_path):
    """An n > 1 request aborted by its rid while its prefill waits: no sample starts, every
    sample's output finishes with abort, nothing leaks."""
    import threading
    import time

    eng = make_stories_engine(stories_path, 2048, max_running_requests=1)
    try:
        long_out: list = []
        t = threading.Thread(
            target=lambda: long_out.append(eng.generate("Once", {"max_new_tokens": 400, "ignore_eos": True}))
        )
        t.start()
        while eng.get_server_info()["num_running_reqs"] == 0:
            time.sleep(0.005)
        outs: list = []
        t2 = threading.Thread(
            target=lambda: outs.append(
                eng.generate("Ben had a", {"n": 3, "max_new_tokens": 50, "ignore_eos": True}, rid="nreq")
            )
        )
        t2.start()
        while eng.get_server_info()["num_waiting_reqs"] == 0:  # the prefill waits behind "Once"
            time.sleep(0.005)
        assert eng.abort_request("nreq") == 1
        t2.join(timeout=60)
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs[0]] == ["abort"] * 3
        assert [o["index"] for o in outs[0]] == [0, 1, 2]
        assert all(o["output_ids"] == [] for o in outs[0])
        assert eng.abort_request(abort_all=True) == 1
        t.join(timeout=60)
        assert long_out[0]["meta_info"]["finish_reason"]["type"] == "abort"
        deadline = time.monotonic() + 30
        while (info := eng.get_server_info())["num_running_reqs"] or info["kv_protected_slots"]:
            assert time.monotonic() < deadline  # the KV of an aborted request goes at the next tick
            time.sleep(0.005)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == 2048
        assert eng.flush_cache() and eng.get_server_info()["kv_free_slots"] == 2048
    finally:
        eng.shutdown()
