"""What the GPU check must carry to the lent GPU machine, and the CPU copy of that machine's Python the smoke run uses.

The device image holds PyTorch and the packages of bench/gpu_image.txt but not this project's pins, and nothing can
be installed there from the network: bench/gpu_wheels.sh downloads the check's packages as wheels (.whl/) and asks
`missing` for every distribution the check needs and the device lacks, until none is left. The check needs what its
scripts import (the module-level imports of every repo module that importing CHECK_MODULES loads, in this repo's
venv; a library a dependency imports only where it is installed is not needed) and every requirement of the carried
wheels that applies to the device's Python (3.12, Linux x86-64).
`image-requirements` names the image's packages among those: the smoke run's environment (`bench/gpu_check.sh
--smoke`) installs exactly these and the carried wheels beside torch, so a module the device lacks fails the smoke
run here too.

    python bench/gpu_packages.py missing .whl            # one name per line; nothing when the set is closed
    python bench/gpu_packages.py image-requirements .whl # the image's packages the carried wheels require
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

ROOT = Path(__file__).resolve().parents[1]
IMAGE = Path(__file__).with_name("gpu_image.txt")
# The scripts bench/gpu_check.sh runs (its preflight imports the same).
CHECK_MODULES = ("bench.finetune", "bench.generate_engine", "bench.device_pin_check")
# The device's interpreter (the image's python3), for the requirements' environment markers.
DEVICE_ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                      "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                      "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def canonical(name: str) -> str:
    """PEP 503's normalized name: `Pydantic_Core` and `pydantic-core` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image() -> set[str]:
    return {canonical(line) for line in IMAGE.read_text().splitlines() if line.strip() and not line.startswith("#")}


def carried(folder: Path) -> set[str]:
    """The distributions of the wheels in `folder` (a wheel's name is `<distribution>-<version>-...whl`)."""
    return {canonical(wheel.name.split("-")[0]) for wheel in folder.glob("*.whl")}


def requirements(wheel: Path) -> set[str]:
    """The distributions a wheel requires on the device (its METADATA's Requires-Dist whose marker holds there;
    optional extras are left out)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode("utf-8", "replace").splitlines()
    found = set()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        try:
            requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
        except InvalidRequirement:
            continue
        if requirement.marker is None or requirement.marker.evaluate(DEVICE_ENVIRONMENT):
            found.add(canonical(requirement.name))
    return found


def imported() -> set[str]:
    """The distributions the repo's modules import at module level, over every repo module that importing
    CHECK_MODULES loads (in this interpreter: this repo's venv)."""
    sys.path.insert(0, str(ROOT))
    for module in CHECK_MODULES:
        importlib.import_module(module)
    names: set[str] = set()
    for module in list(sys.modules.values()):
        path = Path(getattr(module, "__file__", None) or "/")
        if not path.is_relative_to(ROOT) or ".venv" in path.parts:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    owners = importlib.metadata.packages_distributions()
    return {canonical(dist) for name in names for dist in owners.get(name, [])} - {"trainserve"}  # the repo itself


def needed(folder: Path) -> set[str]:
    return imported().union(*(requirements(wheel) for wheel in folder.glob("*.whl")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("missing", "image-requirements"))
    parser.add_argument("folder", type=Path, help="the carried wheels (.whl/)")
    args = parser.parse_args(argv)
    wanted, have = needed(args.folder), carried(args.folder)
    names = wanted - have - image() if args.what == "missing" else (wanted - have) & image()
    # torch is the image's own build (CUDA); the smoke run installs it first, never from this list.
    print("\n".join(sorted(names - {"torch"})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
