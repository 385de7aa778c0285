"""The chat template and what it tells: `--chat-template` (a Jinja file, or the name of a
template shipped in chat_templates/) read and tried on sample conversations before the model
loads; whether a template renders `tools`; which `--tool-call-parser` reads the calls it asks
for; a template's errors described with their line.

Templates compile and render with transformers' `render_jinja_template`, the function (and
sandboxed Jinja environment: `tojson`, `raise_exception`, `{% generation %}`...) that
`tokenizer.apply_chat_template` renders with, so a template that passes here renders the same
way when serving. Importing this module imports no torch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import jinja2

BUILTIN_DIR = Path(__file__).with_name("chat_templates")
# the names --chat-template takes besides a file (SGLang takes these names too)
BUILTIN_TEMPLATES = ("chatml",)

# special tokens the samples render with before the tokenizer loads (apply_chat_template
# passes the tokenizer's; templates write `bos_token + ...`, which fails on an undefined name)
SAMPLE_SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_USER = {"role": "user", "content": "What is the capital of France?"}
_ASSISTANT = {"role": "assistant", "content": "Paris."}
# each sample: a whole conversation, and one waiting for the reply (add_generation_prompt);
# the second sample is for templates that refuse a system message (Gemma's)
SAMPLES: tuple[tuple[str, list[dict[str, Any]], list[dict[str, Any]]], ...] = (
    ("system, user, assistant", [_SYSTEM, _USER, _ASSISTANT], [_SYSTEM, _USER]),
    ("user, assistant", [_USER, _ASSISTANT], [_USER]),
)
SAMPLE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
# text in a chat template -> the --tool-call-parser that reads the calls it teaches, first
# match wins (the markers of pyserve/parsers' formats, as the models' own templates write them)
TOOL_FORMAT_MARKERS = (
    ("[TOOL_CALLS]", "mistral"),
    ("[AVAILABLE_TOOLS]", "mistral"),
    ("<tool_call>", "qwen25"),
    ("[func_name1(", "pythonic"),
    ("<|python_tag|>", "llama3"),
    ("respond with a JSON for a function call", "llama3"),
)
# the x-pyserve-warning header of a chat or tokenize request whose tools the template drops
TOOLS_IGNORED_WARNING = (
    "the chat template ignores tools: the prompt does not show them to the model "
    "(start the server with a --chat-template that renders tools)"
)
WARNING_HEADER = "x-pyserve-warning"


class ChatTemplateError(ValueError):
    """A `--chat-template` that cannot serve: its one-line message starts `--chat-template
    VALUE: ` and gives the reason (with the template's line where there is one)."""


def load_chat_template(value: str) -> str:
    """The text of `--chat-template VALUE`: an existing file's (read as UTF-8), else the
    built-in template of that name, compiled and rendered on SAMPLES (with and without a
    generation prompt) so that a broken one fails here, not at the first chat request.

    Raises ChatTemplateError: no such file or built-in name (the names listed), a folder, an
    unreadable / non-UTF-8 / empty file, a Jinja syntax error, an error rendering a sample, or
    a template that refuses (raise_exception) every sample. Any thread; reads one file."""
    where = f"--chat-template {value}"
    text = _read(value, where)
    problem = sample_problem(text, SAMPLE_SPECIAL_TOKENS)
    if problem is not None:
        raise ChatTemplateError(f"{where}: {problem}")
    return text


def _read(value: str, where: str) -> str:
    path = Path(value)
    if not path.exists() and value in BUILTIN_TEMPLATES:
        path = BUILTIN_DIR / f"{value}.jinja"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        names = ", ".join(BUILTIN_TEMPLATES)
        if os.sep in value or "." in value:  # (meant as a path)
            raise ChatTemplateError(f"{where}: no such file") from None
        raise ChatTemplateError(f"{where}: no such file, nor a built-in template (built-in: {names})") from None
    except IsADirectoryError:
        raise ChatTemplateError(f"{where}: a folder, not a template file") from None
    except OSError as exc:
        raise ChatTemplateError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise ChatTemplateError(f"{where}: the file is empty")
    return text


def render(template: str, messages: list[dict[str, Any]], special_tokens: dict[str, str], **kwargs: Any) -> str:
    """`template` rendered as `tokenizer.apply_chat_template(messages, tokenize=False,
    **kwargs)` renders it, with `special_tokens` as the tokenizer's. Raises what rendering
    raises (jinja2.TemplateError and its subclasses, or any error of the template's code)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    # (rendered texts, generation indices): its annotation says `str`
    out: Any = render_jinja_template(conversations=[messages], chat_template=template, **{**special_tokens, **kwargs})
    return str(out[0][0])


def sample_problem(template: str, special_tokens: dict[str, str]) -> str | None:
    """Why `template` cannot serve chat, in one line ("line N: ..."), or None when it
    renders a sample conversation. A sample the template refuses on purpose
    (`raise_exception`: "roles must alternate", "system role not supported") is skipped;
    any other error fails it at once. Any thread."""
    refusals = []
    for name, whole, waiting in SAMPLES:
        try:
            render(template, whole, special_tokens, add_generation_prompt=False)
            render(template, waiting, special_tokens, add_generation_prompt=True)
        except Exception as exc:
            if isinstance(exc, jinja2.TemplateSyntaxError):  # (not the sample's doing)
                return describe(exc)
            if not is_refusal(exc):
                return f"{describe(exc)} (rendering a sample conversation: {name})"
            refusals.append(f"{name}: {describe(exc)}")
            continue
        return None
    return "the template refuses every sample conversation (" + "; ".join(refusals) + ")"


def is_refusal(exc: BaseException) -> bool:
    """Whether a rendering error is the template refusing the messages on purpose
    (`raise_exception(...)` raises jinja2.TemplateError itself; syntax errors, undefined
    names and the like are its subclasses or other exceptions)."""
    return type(exc) is jinja2.TemplateError


def describe(exc: BaseException) -> str:
    """A template error in one line, with the template's line: "line 3: unexpected '}'"."""
    message = " ".join(str(getattr(exc, "message", None) or exc).split()) or type(exc).__name__
    line = template_line(exc)
    return message if line is None else f"line {line}: {message}"


def template_line(exc: BaseException) -> int | None:
    """The template line an error comes from: a syntax error's own, else the last frame of
    the template in its traceback (Jinja rewrites the frames of template code to the
    template's lines, in a file named "<template>" for a template made from a string)."""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return exc.lineno
    line = None
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


@functools.lru_cache(maxsize=16)
def ignores_tools(template: str) -> bool:
    """Whether `template` renders the same prompt with and without `tools` (a sample list):
    the model would never see a request's tools. False when that cannot be told (the
    samples fail). Cached per template text; any thread."""
    for _, _, waiting in SAMPLES:
        try:
            without = render(template, waiting, SAMPLE_SPECIAL_TOKENS, add_generation_prompt=True)
            with_tools = render(
                template, waiting, SAMPLE_SPECIAL_TOKENS, add_generation_prompt=True, tools=SAMPLE_TOOLS
            )
        except Exception:
            continue
        return without == with_tools
    return False


def tools_template(tokenizer: Any) -> str | None:
    """The template text `tokenizer.apply_chat_template` renders a request with tools with
    (a model with several templates may have one for tools), or None when it has none."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return str(tokenizer.get_chat_template(None, SAMPLE_TOOLS))
    except ValueError:  # several templates and none for this case
        return None


def suggested_tool_parser(template: str | None) -> str | None:
    """The --tool-call-parser whose format `template` teaches the model (by the markers it
    writes: TOOL_FORMAT_MARKERS), or None when it shows none."""
    for marker, parser in TOOL_FORMAT_MARKERS:
        if template is not None and marker in template:
            return parser
    return None
