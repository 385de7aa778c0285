"""instructor and langchain-openai asking a pyserve server for structured output, run by
tests/e2e/test_structured_clients.py in the client venv.

Usage: python structured_clients.py BASE_URL [CASE ...]. Each case runs twice (greedy) and
prints one JSON line: {"case", "runs": [{"type", "value", "request", "response"}, ...]}: the
type and fields of what the client parsed, and the one HTTP exchange behind it (the body the
client sent, the server's answer); or {"case", "error"} when the client raised.
"""

import json
import sys
import traceback
from typing import Literal

from pydantic import BaseModel, Field

MAX_TOKENS = 64
CITY_PROMPT = (
    "Paris is the capital of France. About 2100000 people live there. "
    "Give the city's name, its country and its population."
)
WEATHER_PROMPT = "What is the weather like in Paris today? Answer in celsius."


class City(BaseModel):
    """A city."""

    name: str
    country: str
    population: int


class GetWeather(BaseModel):
    """Get the current weather of a city."""

    city: str = Field(description="the city's name")
    unit: Literal["celsius", "fahrenheit"]


class Recorder:
    """An httpx client for the openai SDK that keeps each request body and response body."""

    def __init__(self) -> None:
        import httpx

        self.exchanges: list[dict] = []
        self.http = httpx.Client(timeout=300, event_hooks={"response": [self._record]})

    def _record(self, response) -> None:
        response.read()
        self.exchanges.append({"request": json.loads(response.request.content), "response": response.json()})

    def run(self, value) -> dict:
        """What the client parsed (`value`: a pydantic model or a list of dicts) and the one
        exchange behind it."""
        assert len(self.exchanges) == 1, self.exchanges
        parsed = value.model_dump() if isinstance(value, BaseModel) else value
        return {"type": type(value).__name__, "value": parsed, **self.exchanges[0]}


def instructor_case(base_url: str, mode_name: str) -> dict:
    import instructor
    import openai

    rec = Recorder()
    client = instructor.from_openai(
        openai.OpenAI(base_url=base_url + "/v1", api_key="unused", http_client=rec.http, max_retries=0),
        mode=getattr(instructor.Mode, mode_name),
    )
    city = client.chat.completions.create(
        model="default",
        response_model=City,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,  # one attempt: a reply that does not validate fails the case
        # JSON mode (response_format json_object) holds the reply to JSON syntax only, the schema
        # is in the prompt: a value's type is the model's choice, so validate in pydantic's lax mode
        strict=mode_name != "JSON",
    )
    return rec.run(city)


def _chat(base_url: str, rec: Recorder):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="default",
        base_url=base_url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        http_client=rec.http,
    )


def langchain_structured(base_url: str, method: str) -> dict:
    rec = Recorder()
    chain = _chat(base_url, rec).with_structured_output(City, method=method)
    return rec.run(chain.invoke([("user", CITY_PROMPT)]))


def langchain_bind_tools(base_url: str, tool_choice: str) -> dict:
    """bind_tools with a forced choice: the calls langchain parsed (name, args)."""
    rec = Recorder()
    message = _chat(base_url, rec).bind_tools([GetWeather], tool_choice=tool_choice).invoke([("user", WEATHER_PROMPT)])
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    return rec.run([{"name": c["name"], "args": c["args"]} for c in message.tool_calls])


CASES = {
    "instructor_tools": lambda url: instructor_case(url, "TOOLS"),
    "instructor_json": lambda url: instructor_case(url, "JSON"),
    "instructor_json_schema": lambda url: instructor_case(url, "JSON_SCHEMA"),
    "langchain_json_schema": lambda url: langchain_structured(url, "json_schema"),
    "langchain_function_calling": lambda url: langchain_structured(url, "function_calling"),
    "langchain_bind_tools_required": lambda url: langchain_bind_tools(url, "required"),
    "langchain_bind_tools_any": lambda url: langchain_bind_tools(url, "any"),
}


def main() -> None:
    base_url = sys.argv[1]
    names = sys.argv[2:] or list(CASES)
    for name in names:
        try:
            result = {"case": name, "runs": [CASES[name](base_url) for _ in range(2)]}
        except Exception:
            result = {"case": name, "error": traceback.format_exc()[-3000:]}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
