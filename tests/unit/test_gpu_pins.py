"""benches/gpu/pins.py: the GPU machine's wheels are pinned to the venv's versions, and a folder
holding any other version is refused with one line naming the wheel."""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import sys
import zipfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benches" / "gpu"))
import pins  # noqa: E402


def _wheel(folder: pathlib.Path, name: str, version: str, tag: str = "py3-none-any") -> pathlib.Path:
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            f"{name.replace('-', '_')}-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        )
    return path


def test_closure_pins_what_the_device_lacks_at_the_venvs_versions() -> None:
    closure = pins.closure()
    # pyserve's own needs the image lacks, and what they need in turn (pydantic's core)
    for name in ("pydantic", "pydantic-core", "starlette", "uvicorn", "orjson", "gguf", "typing-extensions"):
        assert closure[name] == md.version(name)
    # on the device image: never packed
    for name in ("torch", "transformers", "numpy", "jinja2", "tqdm", "aiohttp"):
        assert name not in closure
    # built from this tree, not downloaded; test-only extras left out
    assert not {"pyserve", "pyserve-kernels", "pytest", "openai", "mypy"} & closure.keys()


def test_check_accepts_the_pinned_set(tmp_path: pathlib.Path) -> None:
    pinned = {"pydantic": "2.12.5", "pydantic-core": "2.41.5"}
    _wheel(tmp_path, "pydantic", "2.12.5")
    _wheel(tmp_path, "pydantic-core", "2.41.5", "cp312-cp312-manylinux_2_17_x86_64")
    _wheel(tmp_path, "pyserve", "0.1.0", "cp310-abi3-linux_x86_64")  # ours: not a pin
    assert pins.check(str(tmp_path), pinned) == []


def test_check_refuses_another_version_in_one_line(tmp_path: pathlib.Path) -> None:
    pinned = {"pydantic": "2.12.5", "pydantic-core": "2.41.5"}
    _wheel(tmp_path, "pydantic", "2.14.4")
    _wheel(tmp_path, "pydantic-core", "2.41.5")
    assert pins.check(str(tmp_path), pinned) == [
        "pack.sh: pydantic-2.14.4-py3-none-any.whl: pydantic 2.14.4 differs from the venv's 2.12.5"
    ]


def test_check_refuses_an_unpinned_wheel_and_a_missing_pin(tmp_path: pathlib.Path) -> None:
    _wheel(tmp_path, "orjson", "3.11.0")
    assert pins.check(str(tmp_path), {"pydantic": "2.12.5"}) == [
        "pack.sh: orjson-3.11.0-py3-none-any.whl: orjson is not in pyserve's pinned closure",
        f"pack.sh: no wheel of pydantic==2.12.5 in {tmp_path}",
    ]


def test_main_exits_1_on_a_mismatch(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = "pydantic"
    _wheel(tmp_path, name, "0.0.1")
    assert pins.main(["check", str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"pack.sh: pydantic-0.0.1-py3-none-any.whl: pydantic 0.0.1 differs from the venv's {md.version(name)}"
    )
