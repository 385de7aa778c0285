"""Check that a folder of wheels, installed with --no-deps on the GPU machine, leaves no
runtime requirement unmet (benches/gpu/pack.sh runs it on .gpu/wheels).

Every wheel's METADATA `Requires-Dist` lines (extras left out, markers evaluated for CPython
3.12 on x86-64 Linux, the device's interpreter) must name either another wheel of the folder,
whose version must satisfy the specifier, or a distribution of the device image
(device_packages.txt beside this file; its versions are unknown here, so a specifier on those
is reported, not checked). Also fails on two wheels of one distribution, which makes the
device's `pip install` refuse the whole set.

    python benches/gpu/check_wheel_deps.py .gpu/wheels
"""

from __future__ import annotations

import email.parser
import pathlib
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# The environment markers of the device's interpreter (KINDS.md: Python 3.12.3, x86-64 Linux).
DEVICE_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def device_packages() -> set[str]:
    path = pathlib.Path(__file__).with_name("device_packages.txt")
    lines = (line.strip() for line in path.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line and not line.startswith("#")}


def requirements_of(wheel: pathlib.Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
    reqs = [Requirement(line) for line in meta.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(DEVICE_ENV)]


def main(folder: str) -> int:
    wheels = sorted(pathlib.Path(folder).glob("*.whl"))
    carried: dict[str, Version] = {}
    problems: list[str] = []
    for wheel in wheels:
        name, version, _build, _tags = parse_wheel_filename(wheel.name)
        if name in carried:
            problems.append(f"two wheels of {name}: {carried[name]} and {version}")
        carried[name] = version
    on_device = device_packages()
    notes: list[str] = []
    for wheel in wheels:
        for req in requirements_of(wheel):
            name = canonicalize_name(req.name)
            if name in carried:
                if req.specifier and not req.specifier.contains(carried[name], prereleases=True):
                    problems.append(f"{wheel.name} needs {req}, carried {carried[name]}")
            elif name in on_device:
                if req.specifier:
                    notes.append(str(req))
            else:
                problems.append(f"{wheel.name} needs {req}: neither carried nor on the device")
    if notes:
        print("  taken from the device image, versions assumed to fit:", ", ".join(sorted(set(notes))))
    for line in problems:
        print(f"  MISSING: {line}")
    print(f"check_wheel_deps: {len(wheels)} wheels, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
