"""The README's examples run as written and answer: every ```python block, and every ```bash
block that calls the server (`curl` or `python -c`), against `pyserve serve` on the default
model (SmolLM2-135M-Instruct Q4_1), as a reader who ran `make serve` would run them. Each must
finish within a minute (the issue's promise to a newcomer) with a non-empty answer and no error
object; the ports the README names are mapped to free ones."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, start_server

README = REPO / "README.md"
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)
DEFAULT_PORT = 30000  # `make serve`'s, which the README's examples call
BUDGET_S = 60.0


def readme_examples() -> list[tuple[str, str, int]]:
    """(language, code, line) of each README block a reader runs against a server or Engine."""
    text = README.read_text()
    found = []
    for m in BLOCK.finditer(text):
        lang, code = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if lang == "python" or "curl " in code or "python -c" in code:
            found.append((lang, code, line))
    return found


EXAMPLES = readme_examples()


def test_the_readme_has_the_examples_this_test_runs():
    langs = [lang for lang, _, _ in EXAMPLES]
    # the quick start's curls, the Engine, the openai client, the embeddings server
    assert langs.count("python") >= 2 and langs.count("bash") >= 2, EXAMPLES


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "readme", [])  # as `make serve` starts it
    try:
        yield srv
    finally:
        srv.stop()


def json_answers(stdout: str) -> list[dict]:
    """The JSON objects printed one after another (curl prints bodies back to back)."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    text = stdout.strip()
    while i < len(text):
        obj, end = decoder.raw_decode(text, i)
        out.append(obj)
        i = end
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def answer_text(obj: dict) -> str:
    if "choices" in obj:
        choice = obj["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    return obj["text"]


@pytest.mark.parametrize("lang,code,line", EXAMPLES, ids=[f"{lang}-line{line}" for lang, _, line in EXAMPLES])
def test_readme_example_answers(server, tmp_path, lang, code, line):
    ports = {DEFAULT_PORT: server.port}
    for other in sorted({int(p) for p in re.findall(r"\b(300\d\d)\b", code)} - {DEFAULT_PORT}):
        ports[other] = free_port()
    for old, new in ports.items():
        code = code.replace(f":{old}", f":{new}").replace(f"--port {old}", f"--port {new}")
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}
    argv = ["bash", "-c", "set -e\n" + code] if lang == "bash" else [sys.executable, "-c", code]
    # a session of its own, so a server the block starts in the background goes with it; output
    # to files, not pipes, which such a server would hold open after the block ends
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            proc.wait(timeout=BUDGET_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    stdout, stderr = out_path.read_text(), err_path.read_text()
    assert proc.returncode != -signal.SIGKILL, (
        f"README line {line}: not finished within {BUDGET_S:.0f} s\n{stderr[-3000:]}"
    )
    assert proc.returncode == 0, f"README line {line}: exit {proc.returncode}\n{stderr[-3000:]}"
    assert stdout.strip(), f"README line {line}: printed nothing\n{stderr[-3000:]}"
    if "curl " in code and "python -c" not in code:
        answers = json_answers(stdout)
        assert len(answers) == code.count("curl "), stdout
        for obj in answers:
            assert "error" not in obj, obj
            assert answer_text(obj).strip(), obj
