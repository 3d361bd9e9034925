"""bench/gpu_packages.py: what the GPU check carries is every distribution it needs that the device image lacks,
read from the wheels' own metadata under the device's Python."""

from __future__ import annotations

import zipfile
from pathlib import Path

from bench import gpu_packages


def wheel(folder: Path, name: str, *requires: str) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        lines = [f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]
        archive.writestr(f"{name}-1.0.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_requirements_hold_under_the_devices_python_and_leave_extras_out(tmp_path: Path) -> None:
    found = gpu_packages.requirements(wheel(
        tmp_path, "Huggingface_Hub", "httpx2>=2", "tomli; python_version < '3.11'", "PyYAML>=5",
        "pytest; extra == 'testing'", "pywin32; sys_platform == 'win32'"))
    assert found == {"httpx2", "pyyaml"}


def test_missing_names_what_neither_the_image_nor_the_wheels_hold(tmp_path: Path, monkeypatch) -> None:
    wheel(tmp_path, "transformers", "huggingface-hub", "numpy", "safetensors")
    wheel(tmp_path, "huggingface_hub", "httpx2", "PyYAML")
    monkeypatch.setattr(gpu_packages, "imported", lambda: {"llguidance", "torch"})
    assert gpu_packages.needed(tmp_path) - gpu_packages.carried(tmp_path) - gpu_packages.image() == \
        {"httpx2", "llguidance"}  # safetensors, numpy, torch, PyYAML: the image has them
    assert gpu_packages.main(["missing", str(tmp_path)]) == 0


def test_the_repos_own_imports_of_the_check_are_found() -> None:
    assert {"torch", "transformers", "llguidance"} <= gpu_packages.imported()
