"""Models by their Hugging Face Hub id, served from a Hugging Face cache laid out by hand in a
temporary HF_HOME (stories260k as `pyserve-test/stories260k`) with HF_HUB_OFFLINE=1: what a Hub
id is, what is fetched after the config, the resolved paths and the one-line errors, an
Engine on a Hub id, and `pyserve serve` refusing an uncached id before torch loads.

huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported, so everything that
resolves runs in a fresh interpreter with that environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyserve.model_loader.hub import hub_id, remaining_files
from tests.unit.test_cli_startup import PROBE  # main() in a fresh interpreter, reporting whether torch loaded

REPO = "pyserve-test/stories260k"
GGUF_REPO = "pyserve-test/gguf-only"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GGUF_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
MISSING = "nosuch-org/nosuch-model"

# resolve_model_path / resolve_hub_paths on the cases in argv[1]; prints one JSON list
RESOLVE = """
import json, sys
from pyserve.config import ServerArgs
from pyserve.model_loader.default_model import ModelNotFoundError
from pyserve.model_loader.hub import resolve_hub_paths, resolve_model_path
results = []
for path, revision in json.loads(sys.argv[1]):
    try:
        results.append(["path", resolve_model_path(path, revision)])
    except ModelNotFoundError as exc:
        results.append(["error", str(exc)])
args = resolve_hub_paths(ServerArgs(model_path=sys.argv[2], tokenizer_path=sys.argv[2]))
results.append([args.model_path, args.tokenizer_path, args.served_model_name])
print(json.dumps(results))
"""

# an Engine on the Hub id: greedy ids of case argv[1], its paths and name; then one on a
# missing id
ENGINE = """
import json, sys
from pyserve import Engine
from pyserve.model_loader.default_model import ModelNotFoundError
case = json.loads(sys.argv[1])
engine = Engine(model_path=sys.argv[2], max_total_tokens=256, max_running_requests=2)
try:
    out = engine.generate(
        input_ids=case["input_ids"], sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    )
    info = engine.core.get_model_info()
finally:
    engine.shutdown()
try:
    Engine(model_path=sys.argv[3])
    missing = None
except ModelNotFoundError as exc:
    missing = str(exc)
print(json.dumps([out["output_ids"], engine.core.model_name, info["model_path"], info["tokenizer_path"], missing]))
"""


def add_to_cache(hub: Path, repo_id: str, commit: str) -> Path:
    """An empty snapshot of `repo_id` at `commit` that refs/main points to (the cache's
    layout: models--ORG--NAME/{refs/main, snapshots/<commit>/})."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)  # no newline: huggingface_hub reads it verbatim
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, stories_path) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    snapshot = add_to_cache(home / "hub", REPO, COMMIT)
    for name in os.listdir(stories_path):
        shutil.copy(stories_path / name, snapshot / name)
    (add_to_cache(home / "hub", GGUF_REPO, GGUF_COMMIT) / "m.Q8_0.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    return home


def offline(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT")}
    return dict(env, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")


def run(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, env=env)


def not_cached(where: str, hf_home: Path) -> str:
    return (
        f"{where}: not in the Hugging Face cache ({hf_home}/hub) and HF_HUB_OFFLINE is set; "
        "download it once with network access or pass a local folder"
    )


def test_hub_ids_are_missing_paths_that_read_as_repo_ids(stories_path, tmp_path, monkeypatch):
    assert hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert hub_id("gpt2") is None  # a bare name: a local file or folder mistyped, not the Hub
    assert hub_id("org/model.gguf") is None  # a local file in a folder named org
    assert hub_id("org/model.safetensors") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert hub_id("checkpoints/run-1") is None  # its first folder exists here: a local path not made yet
    assert hub_id("elsewhere/run-1") == ("elsewhere/run-1", None)
    assert hub_id("org/name/sub/m.Q4_K_M.gguf") == ("org/name", "sub/m.Q4_K_M.gguf")
    assert hub_id(str(stories_path)) is None  # exists: a local folder
    assert hub_id("./org/name") is None
    assert hub_id("/no/such/folder") is None
    assert hub_id("~/models/name") is None
    assert hub_id("org/name/sub") is None  # three parts that are not a .gguf file
    assert hub_id("org--x/name") is None  # validate_repo_id refuses '--'


def test_what_is_fetched_after_the_config(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    shards = {"a": second, "b": first, "c": first}  # a shard holds several tensors
    (index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    (index / "modules.json").write_text(json.dumps([{"path": ""}, {"path": "1_Pooling"}, {"path": "2_Normalize"}]))
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").write_bytes(b"")
    neither = tmp_path / "neither"
    neither.mkdir()
    assert remaining_files(str(index)) == (
        [first, second, "1_Pooling/config.json", "2_Normalize/config.json"],
        None,
    )
    assert remaining_files(str(single)) == ([], None)
    assert remaining_files(str(neither)) == (["*.safetensors"], ["*/*.safetensors"])


def test_hub_ids_resolve_to_cached_snapshots_offline(hf_home, stories_path):
    snapshot = str((hf_home / "hub" / "models--pyserve-test--stories260k" / "snapshots" / COMMIT).resolve())
    gguf = hf_home / "hub" / "models--pyserve-test--gguf-only" / "snapshots" / GGUF_COMMIT / "m.Q8_0.gguf"
    cases = [
        [REPO, None],
        [REPO, COMMIT],
        [REPO, "v9"],
        [MISSING, None],
        [f"{GGUF_REPO}/m.Q8_0.gguf", None],
        [GGUF_REPO, None],
        [str(stories_path), "v9"],  # a local folder: the revision is not used
        ["./no/such/folder", None],  # not a Hub id: check_model_path reports it
    ]
    proc = run(RESOLVE, offline(hf_home), json.dumps(cases), REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [
        ["path", snapshot],
        ["path", snapshot],
        ["error", not_cached(f"--model-path {REPO} --revision v9", hf_home)],
        ["error", not_cached(f"--model-path {MISSING}", hf_home)],
        ["path", str(gguf.resolve())],
        [
            "error",
            f"--model-path {GGUF_REPO}: the repository has no config.json; to serve one of its GGUF files, "
            f"pass --model-path {GGUF_REPO}/m.Q8_0.gguf",
        ],
        ["path", str(stories_path)],
        ["path", "./no/such/folder"],
        [snapshot, snapshot, [REPO]],
    ]


def test_an_engine_serves_a_hub_id(hf_home, stories_reference):
    case = stories_reference[0]
    proc = run(ENGINE, offline(hf_home), json.dumps(case), REPO, MISSING)
    assert proc.returncode == 0, proc.stderr
    snapshot = str((hf_home / "hub" / "models--pyserve-test--stories260k" / "snapshots" / COMMIT).resolve())
    assert json.loads(proc.stdout) == [
        case["output_ids"][:8],
        REPO,
        snapshot,
        snapshot,
        not_cached(f"--model-path {MISSING}", hf_home),
    ]


def test_serve_refuses_an_uncached_hub_id_offline_before_torch_loads(hf_home):
    proc = run(PROBE, offline(hf_home), "serve", "--model-path", MISSING)
    message = not_cached(f"--model-path {MISSING}", hf_home)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"pyserve: error: {message}\n", "torch imported: False\n")
