"""The wheels the GPU machine needs, pinned to the project's venv, and the check that a folder
of wheels holds exactly those versions (benches/gpu/pack.sh runs both).

`closure`: pyserve's runtime requirements (its installed METADATA, markers evaluated for the
device's CPython 3.12), followed through each requirement's own, minus what the device image
has (device_packages.txt, except FORCED), each pinned to the version installed in the venv
that runs this script: the set the test suite ran with.

`check`: every dependency wheel of a folder must be one of those pins at the same version;
a wheel that differs, or a pin with no wheel, is refused with one line naming it.

    python benches/gpu/pins.py closure              # prints name==version lines
    python benches/gpu/pins.py check .gpu/wheels    # exit 1, one line per mismatch
"""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from check_wheel_deps import DEVICE_ENV, device_packages  # noqa: E402

# On the device image, but the version pyserve's pins need may be newer than the image's
# (pydantic needs typing-extensions >= 4.14; the image's version is not listed): it travels.
FORCED = {"typing-extensions"}
# Built from this tree by pack.sh, not downloaded.
OURS = {"pyserve", "pyserve-kernels"}


def closure(root: str = "pyserve") -> dict[str, str]:
    """{canonical name: venv version} of everything `root` needs at run time that the device
    lacks. Raises LookupError naming a requirement the venv does not have installed."""
    on_device = device_packages() - FORCED
    pins: dict[str, str] = {}
    todo = [root]
    seen: set[str] = set()
    while todo:
        dist = todo.pop()
        for line in md.requires(dist) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(DEVICE_ENV):
                continue  # extras (the marker names one) and other platforms' needs
            name = canonicalize_name(req.name)
            if name in seen or name in on_device:
                continue
            seen.add(name)
            if name not in OURS:
                try:
                    pins[name] = md.version(name)
                except md.PackageNotFoundError:
                    raise LookupError(f"{dist} needs {req}, which the venv does not have") from None
            todo.append(name)
    return dict(sorted(pins.items()))


def check(folder: str, pins: dict[str, str]) -> list[str]:
    """One line per wheel of `folder` whose version is not the venv's, whose distribution is
    not pinned, or per pin with no wheel. pyserve's own wheels are not checked here."""
    problems = []
    found: set[str] = set()
    for wheel in sorted(pathlib.Path(folder).glob("*.whl")):
        name, version, _build, _tags = parse_wheel_filename(wheel.name)
        if name in OURS:
            continue
        found.add(name)
        if name not in pins:
            problems.append(f"pack.sh: {wheel.name}: {name} is not in pyserve's pinned closure")
        elif version != Version(pins[name]):
            problems.append(f"pack.sh: {wheel.name}: {name} {version} differs from the venv's {pins[name]}")
    problems += [
        f"pack.sh: no wheel of {name}=={version} in {folder}" for name, version in pins.items() if name not in found
    ]
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["closure"] and len(argv) == 1:
        print("\n".join(f"{name}=={version}" for name, version in closure().items()))
        return 0
    if argv[:1] == ["check"] and len(argv) == 2:
        problems = check(argv[1], closure())
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
