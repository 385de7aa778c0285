"""llama.cpp's own greedy tokens (llama-cpp-python's `Llama`) for prompts given as token ids, run
by tests/e2e/test_gguf_vs_llamacpp.py in the client venv.

Usage: python llamacpp_greedy.py GGUF PROMPTS_JSON OUT_JSON MAX_NEW_TOKENS. PROMPTS_JSON holds a
list of token-id lists; OUT_JSON receives {"output_ids": [[id, ...], ...], "n_vocab": int,
"llama_cpp_version": str, "seconds": float}: exactly MAX_NEW_TOKENS ids per prompt.

The ids are fed as they are (`Llama.eval` tokenizes nothing, so no BOS is added). Each prompt
starts from an empty KV cache (`reset()` before `generate`: generate's prefix reuse would
otherwise prefill a shared chat-template prefix once and only the rest of the next prompt).
`generate(temp=0.0, repeat_penalty=1.0)` builds llama.cpp's sampler chain as penalties (a no-op
at repeat 1, frequency 0, presence 0) then `greedy` (the first id of the largest logit); each
token is also checked against numpy's argmax of the logits llama.cpp returned for that step.
`generate` never stops on EOS (only `create_completion` does): the loop takes MAX_NEW_TOKENS.
"""

import json
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

gguf, prompts_path, out_path, max_new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = json.loads(Path(prompts_path).read_text())
n_ctx = max(512, max(len(p) for p in prompts) + max_new_tokens)
llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=2, logits_all=False, verbose=False, seed=0)
n_vocab = llm.n_vocab()
start = time.perf_counter()
outputs = []
for ids in prompts:
    llm.reset()
    out: list[int] = []
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        assert token == int(np.argmax(logits)), (token, int(np.argmax(logits)))
        out.append(int(token))
        if len(out) == max_new_tokens:
            break
    outputs.append(out)
seconds = time.perf_counter() - start
llm.close()
Path(out_path).write_text(
    json.dumps(
        {"output_ids": outputs, "n_vocab": n_vocab, "llama_cpp_version": llama_cpp.__version__, "seconds": seconds}
    )
)
