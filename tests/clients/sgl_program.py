"""An SGLang frontend-language program (`sgl.function` over `sgl.RuntimeEndpoint`), run by
tests/e2e/test_real_clients.py in the client venv against a pyserve server.

Usage: python sgl_program.py BASE_URL OUT.json. It runs `gen` (greedy, with a stop string),
`select` between three continuations, and a two-turn chat, and writes what each returned.
"""

import json
import sys

import sglang as sgl

CHOICES = [" park", " moon", " table"]


@sgl.function
def story(s, start):
    s += start
    s += sgl.gen("cont", max_tokens=12, temperature=0, stop=".")
    s += " Then they went to the"
    s += sgl.select("place", choices=CHOICES)


@sgl.function
def chat(s):
    s += sgl.system("You tell short stories.")
    s += sgl.user("Tell me about Lily.")
    s += sgl.assistant(sgl.gen("first", max_tokens=8, temperature=0))
    s += sgl.user("And Tom?")
    s += sgl.assistant(sgl.gen("second", max_tokens=8, temperature=0))


def main() -> None:
    base_url, out_path = sys.argv[1], sys.argv[2]
    sgl.set_default_backend(sgl.RuntimeEndpoint(base_url))
    s = story.run(start="Once upon a time, Lily and Tom")
    c = chat.run()
    meta = s.get_meta_info("place")
    result = {
        "cont": s["cont"],
        "place": s["place"],
        "story_text": s.text(),
        "select_meta": {k: meta[k] for k in ("normalized_prompt_logprobs", "input_token_logprobs")},
        "chat_first": c["first"],
        "chat_second": c["second"],
        "chat_text": c.text(),
        "chat_messages": c.messages(),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
