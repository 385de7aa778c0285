"""The triton attention backend inside the real model (stories260k, float32), its kernels run
by Triton's interpreter on CPU: greedy tokens equal the torch_native reference's, with a
cached prefix (EXTEND over cached pages), ragged batches, and pages of 1 and 16."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from tests.conftest import make_stories_engine  # noqa: E402

LONG = [1] + [(37 * i) % 500 + 3 for i in range(17)]  # 18 tokens: one full page of 16
PROMPTS = [LONG, LONG + [78, 292, 27, 44], [1, 90, 501]]
PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU run: needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_greedy_equals_torch_native(stories_path, page_size) -> None:
    outs = {}
    for backend in ("torch_native", "triton"):
        eng = make_stories_engine(stories_path, 1024, page_size=page_size, attention_backend=backend)
        try:
            first = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
            # the second prompt is now cached (whole pages of it with page size 16): its EXTEND
            # attends over a cached prefix read through req_to_token
            again = eng.generate(input_ids=PROMPTS[1], sampling_params=PARAMS)
            outs[backend] = (first, again["output_ids"], again["meta_info"]["cached_tokens"])
            assert eng.get_server_info()["attention_backend"] == backend
        finally:
            eng.shutdown()
    assert outs["triton"] == outs["torch_native"]
    assert outs["triton"][2] >= 16
    assert outs["triton"][1] == outs["triton"][0][1]  # the cached prefix changes nothing
