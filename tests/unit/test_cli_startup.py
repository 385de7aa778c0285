"""`pyserve serve` refuses a bad --model-path or a busy port in one line, exit status 2,
before torch or the model loads; `--version`; an unknown flag gets one line naming it."""

from __future__ import annotations

import socket
import subprocess
import sys
from importlib import metadata

import pytest

import pyserve
from pyserve.model_loader import ModelNotFoundError
from pyserve.model_loader.model_path import check_model_path

# main() in a fresh interpreter; the last line says whether torch was imported by then
PROBE = """
import sys
from pyserve.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
print("torch imported:", "torch" in sys.modules)
sys.exit(rc)
"""


def run_cli(*args: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def paths(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with_gguf = tmp_path / "holds-gguf"
    with_gguf.mkdir()
    (with_gguf / "b.Q8_0.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (with_gguf / "a.Q4_1.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return {"missing": tmp_path / "nope", "empty": empty, "with_gguf": with_gguf, "weights": weights}


def test_bad_model_paths_fail_in_one_line_before_torch_loads(paths):
    want = {
        "missing": f"--model-path {paths['missing']}: no such file or folder",
        "empty": f"--model-path {paths['empty']}: a folder without config.json (a model folder holds config.json "
        "and its *.safetensors weights)",
        "with_gguf": f"--model-path {paths['with_gguf']}: a folder without config.json (to serve the GGUF in it, "
        f"pass --model-path {paths['with_gguf'] / 'a.Q4_1.gguf'})",
        "weights": f"--model-path {paths['weights']}: a file that is not a GGUF model (pass a .gguf file, or the "
        "folder holding config.json)",
    }
    for case, message in want.items():
        rc, out, err = run_cli("serve", "--model-path", str(paths[case]))
        assert (rc, err, out) == (2, f"pyserve: error: {message}\n", "torch imported: False\n"), case
        with pytest.raises(ModelNotFoundError) as info:
            check_model_path(str(paths[case]))
        assert str(info.value) == message


def test_model_paths_that_are_models_pass(stories_path, paths):
    check_model_path(str(stories_path))
    check_model_path(str(paths["with_gguf"] / "a.Q4_1.gguf"))


def test_a_busy_port_fails_in_one_line_before_torch_loads(stories_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, out, err = run_cli("serve", "--model-path", str(stories_path), "--port", str(port))
    assert rc == 2 and out == "torch imported: False\n"
    assert err == f"pyserve: error: --host 127.0.0.1 --port {port}: cannot bind (Address already in use)\n"


def test_version_and_usage():
    version = metadata.version("pyserve")
    assert pyserve.__version__ == version
    rc, out, _ = run_cli("--version")
    assert (rc, out) == (0, f"pyserve {version}\ntorch imported: False\n")
    rc, out, err = run_cli("serve", "--no-such-flag")
    assert (rc, out) == (2, "torch imported: False\n")
    assert err == "pyserve serve: error: unrecognized argument --no-such-flag (see pyserve serve --help)\n"


def test_the_engine_raises_the_same_typed_error(paths):
    engine_cls = pyserve.Engine
    with pytest.raises(ModelNotFoundError, match=r": a folder without config\.json \(to serve the GGUF"):
        engine_cls(model_path=str(paths["with_gguf"]), log_level="warning")
