"""The README's install is the route CI takes, and the versions it resolves are the tested ones."""

from __future__ import annotations

import re
import shlex
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_setup_line() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up and run the main job", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 1, "the README's set-up is one command line"
    return lines[0]


def test_ci_installs_exactly_what_the_readme_installs():
    readme_pips = [part.strip() for part in _readme_setup_line().split("&&") if part.strip().startswith("pip install")]
    ci_pips = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
               if line.strip().startswith("pip install")]
    assert readme_pips and ci_pips == readme_pips


def test_ci_runs_the_readme_test_command():
    text = (ROOT / "README.md").read_text()
    test_block = text.split("## Run the tests", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert test_block == "python3 -m pytest -q"
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == test_block


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _extra_names(spec: str) -> list[str]:
    match = re.fullmatch(r"fasttrain\[(.+)\]", spec)
    return match.group(1).split(",") if match else []


def _expand(extra: str, extras: dict) -> list[str]:
    out = []
    for spec in extras[extra]:
        names = _extra_names(spec)
        out += [s for name in names for s in _expand(name, extras)] if names else [spec]
    return out


def test_the_readme_extra_holds_no_gpu_only_library():
    extras = _pyproject()["project"]["optional-dependencies"]
    installed_by_readme = re.search(r'pip install -e "\.\[(\w+)\]"', _readme_setup_line()).group(1)
    packages = {re.split(r"[<>=!~ ]", s, maxsplit=1)[0] for s in _expand(installed_by_readme, extras)}
    assert not packages & {"cupy-cuda13x", "nvmath-python", "nvidia-cudnn-cu13"}
    cpu = {re.split(r"[<>=!~ ]", s, maxsplit=1)[0] for s in _expand("cpu", extras)}
    assert cpu == {"torch", "jax", "matplotlib"}  # a CPU-only machine is not made to pull Triton


def test_tested_ranges_have_upper_bounds():
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    specs = list(project["dependencies"]) + [s for name in ("test", "cpu", "triton") for s in _expand(name, extras)]
    unbounded = [s for s in specs if "<" not in s]
    assert not unbounded, f"no tested upper bound: {unbounded}"


def test_the_installed_versions_lie_in_the_stated_ranges():
    requirements = pytest.importorskip("packaging.requirements")
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    checked = 0
    for spec in list(project["dependencies"]) + _expand("test", extras):
        req = requirements.Requirement(spec)
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue  # an extra not installed here: its engine or test skips and says why
        # local build tags (2.13.0+cpu) are not part of the range
        assert req.specifier.contains(version.split("+")[0], prereleases=True), f"{req.name} {version} not in {spec}"
        checked += 1
    assert checked >= 5


def test_shlex_parses_the_setup_line():
    words = shlex.split(_readme_setup_line())
    assert words[:3] == ["pip", "install", "torch==2.13.0"]
