"""SGLang frontend-language programs with constrained `gen` calls, run by
tests/e2e/test_structured_clients.py in the client venv against a pyserve server.

Usage: python sgl_structured.py BASE_URL OUT.json. Runs each program twice (greedy) and writes
what each `gen` returned, with its meta info's finish reason.
"""

import json
import sys

import sglang as sgl

IP_REGEX = r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}
PROMPTS = {
    "ip": "The IP address of Google's public DNS server is ",
    "legs": "Q: How many legs does a dog have?\nA: ",
    "city": "Paris is the capital of France, with 2100000 inhabitants. As JSON:\n",
}


@sgl.function
def regex_program(s):
    s += PROMPTS["ip"]
    s += sgl.gen("ip", max_tokens=24, temperature=0, regex=IP_REGEX)


@sgl.function
def int_program(s):
    s += PROMPTS["legs"]
    s += sgl.gen("legs", max_tokens=8, temperature=0, dtype=int)


@sgl.function
def json_program(s):
    s += PROMPTS["city"]
    s += sgl.gen("city", max_tokens=96, temperature=0, json_schema=json.dumps(CITY_SCHEMA))


def main() -> None:
    base_url, out_path = sys.argv[1], sys.argv[2]
    sgl.set_default_backend(sgl.RuntimeEndpoint(base_url))
    result: dict = {"ip_regex": IP_REGEX, "city_schema": CITY_SCHEMA, "prompts": PROMPTS}
    for program, name in ((regex_program, "ip"), (int_program, "legs"), (json_program, "city")):
        runs = []
        for _ in range(2):
            state = program.run()
            runs.append({"value": state[name], "text": state.text(), "meta": state.get_meta_info(name)})
        result[name] = runs
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
