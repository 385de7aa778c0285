"""--chat-template is read, compiled and tried on sample conversations before the model loads
(pyserve/model_loader/chat_template.py): a bad one is one line and exit status 2, before torch
loads; the built-in names; what a template tells about tools (ignored; the --tool-call-parser
its markers point to) and the 400 of tools without a parser that says so."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pyserve.errors import InvalidRequestError
from pyserve.model_loader.chat_template import (
    BUILTIN_DIR,
    SAMPLE_SPECIAL_TOKENS,
    SAMPLES,
    ChatTemplateError,
    ignores_tools,
    load_chat_template,
    render,
    suggested_tool_parser,
)
from pyserve.server.openai.chat_reply import reply_plan
from pyserve.server.openai.protocol import ChatCompletionRequest
from tests.conftest import CHAT_TEMPLATE, REPO
from tests.unit.test_cli_startup import run_cli

TOOLS_TEMPLATE = REPO / "tests" / "data" / "stories_tools_chat_template.jinja"
# line 3 closes the loop with a mistyped tag
BROKEN = "{%- for m in messages -%}\n{{ m['content'] }}\n{%- endfo -%}\n"
BROKEN_REASON = (
    "line 3: Encountered unknown tag 'endfo'. Jinja was looking for the following tags: 'endfor' or 'else'. "
    "The innermost block that needs to be closed is 'for'."
)


def test_a_missing_template_file_fails_in_one_line_with_status_2(stories_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyserve",
            "serve",
            "--chat-template",
            "nosuch.jinja",
            "--model-path",
            str(stories_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert (proc.returncode, proc.stderr) == (2, "pyserve: error: --chat-template nosuch.jinja: no such file\n")


def test_an_unknown_name_and_a_broken_template_fail_before_torch_loads(stories_path, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text(BROKEN)
    want = {
        "chatm": "--chat-template chatm: no such file, nor a built-in template (built-in: chatml)",
        str(broken): f"--chat-template {broken}: {BROKEN_REASON}",
    }
    for value, message in want.items():
        rc, out, err = run_cli("serve", "--model-path", str(stories_path), "--chat-template", value)
        assert (rc, err, out) == (2, f"pyserve: error: {message}\n", "torch imported: False\n"), value


def _refused(tmp_path, name: str, data: bytes | str) -> str:
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    with pytest.raises(ChatTemplateError) as info:
        load_chat_template(str(path))
    prefix = f"--chat-template {path}: "
    assert str(info.value).startswith(prefix)
    return str(info.value).removeprefix(prefix)


def test_each_reason_a_template_cannot_serve(tmp_path):
    with pytest.raises(ChatTemplateError) as info:
        load_chat_template(str(tmp_path))
    assert str(info.value) == f"--chat-template {tmp_path}: a folder, not a template file"
    assert _refused(tmp_path, "empty.jinja", " \n") == "the file is empty"
    assert _refused(tmp_path, "latin1.jinja", b"caf\xe9") == "not UTF-8 text (byte 3)"
    assert _refused(tmp_path, "broken.jinja", BROKEN) == BROKEN_REASON
    undefined = (
        "{%- for m in messages -%}\n{%- if m['role'] == 'assistant' -%}\n"
        "{{ m['content'] + m.missing }}\n{%- endif -%}{%- endfor -%}"
    )
    assert _refused(tmp_path, "undefined.jinja", undefined) == (
        "line 3: 'dict object' has no attribute 'missing' (rendering a sample conversation: system, user, assistant)"
    )
    assert _refused(tmp_path, "refuses.jinja", "\n{{ raise_exception('no chat here') }}") == (
        "the template refuses every sample conversation "
        "(system, user, assistant: line 2: no chat here; user, assistant: line 2: no chat here)"
    )


def test_templates_that_pass_and_the_builtin_chatml(tmp_path):
    assert load_chat_template(str(CHAT_TEMPLATE)) == CHAT_TEMPLATE.read_text()
    assert load_chat_template(str(TOOLS_TEMPLATE)) == TOOLS_TEMPLATE.read_text()
    # a template refusing a system message (Gemma's) serves the conversations without one
    no_system = tmp_path / "no_system.jinja"
    no_system.write_text(
        "{%- if messages[0]['role'] == 'system' -%}{{ raise_exception('System role not supported') }}{%- endif -%}"
        "{{ bos_token }}{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + eos_token }}{%- endfor -%}"
    )
    assert load_chat_template(str(no_system)) == no_system.read_text()
    chatml = load_chat_template("chatml")
    assert chatml == (BUILTIN_DIR / "chatml.jinja").read_text()
    _, _, waiting = SAMPLES[0]
    assert render(chatml, waiting, SAMPLE_SPECIAL_TOKENS, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_which_templates_ignore_tools():
    assert ignores_tools(CHAT_TEMPLATE.read_text()) is True
    assert ignores_tools(load_chat_template("chatml")) is True
    assert ignores_tools(TOOLS_TEMPLATE.read_text()) is False


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{- '[AVAILABLE_TOOLS] ' + tools|tojson + '[/AVAILABLE_TOOLS]' }}", "mistral"),
        ("{{- '[TOOL_CALLS] ' }}", "mistral"),
        ("{{- '<tool_call>\\n' + tool_call|tojson + '\\n</tool_call>' }}", "qwen25"),
        ("you MUST put it in the format of [func_name1(params_name1=params_value1)]", "pythonic"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3"),
        ("Given the following functions, please respond with a JSON for a function call", "llama3"),
        (CHAT_TEMPLATE.read_text(), None),
        (None, None),
    ],
)
def test_the_parser_a_template_points_to(template, parser):
    assert suggested_tool_parser(template) == parser


def test_tools_without_a_parser_name_the_parser_the_template_points_to():
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}
    )
    forced = "tool_choice required or a named function works without one"
    need = "tools with tool_choice auto need a server started with --tool-call-parser"
    want = {
        "{{- '<tool_call>' }}": f"{need}: this model's chat template writes calls in the qwen25 format "
        f"(--tool-call-parser qwen25); {forced}",
        CHAT_TEMPLATE.read_text(): f"{need} and a chat template that renders tools (this model's ignores them: "
        f"give --chat-template); {forced}",
        TOOLS_TEMPLATE.read_text(): f"{need} (the model's format: qwen25, llama3, mistral, pythonic); {forced}",
    }
    for template, message in want.items():
        with pytest.raises(InvalidRequestError) as info:
            reply_plan(body, None, None, template)
        assert (info.value.message, info.value.param) == (message, "tools")
