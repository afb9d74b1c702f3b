"""The install metadata leaves slime's stack alone: ``install_requires`` are ranges that admit slime's container
(torch 2.11, Megatron-LM from git, which registers as ``megatron-core 0.16.0rc0``) and the newest releases (torch
2.15, megatron-core 0.19.2); no extra that cannot install (no ``gpu`` extra, nothing naming apex / transformer-engine /
sglang); the constraints files CI installs with pin versions inside those ranges."""

from __future__ import annotations

import os
import re
import runpy
from unittest import mock

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONSTRAINTS = ("constraints/ci-py311.txt", "constraints/ci-py312.txt")


def _setup_kwargs() -> dict:
    captured: dict = {}
    with mock.patch("setuptools.setup", lambda **kw: captured.update(kw)):
        runpy.run_path(os.path.join(_ROOT, "setup.py"), run_name="__main__")
    return captured


def _requirements() -> dict:
    reqs = [Requirement(r) for r in _setup_kwargs()["install_requires"]]
    return {canonicalize_name(r.name): r for r in reqs}


def _pins(path: str) -> dict:
    pins = {}
    with open(os.path.join(_ROOT, path)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
                assert m, f"{path}: not an exact pin: {line!r}"
                pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


@pytest.mark.parametrize("name, version", [
    ("torch", "2.11.0"), ("torch", "2.11.0+cu129"), ("torch", "2.13.0+cpu"), ("torch", "2.15.0"),
    ("megatron-core", "0.16.0rc0"),  # Megatron-LM from git at slime's commit (pip install -e of the checkout)
    ("megatron-core", "0.16.1"), ("megatron-core", "0.17.0rc0"), ("megatron-core", "0.18.0.dev0"),
    ("megatron-core", "0.19.2"),
])
def test_ranges_admit_slimes_stack_and_the_newest_releases(name, version):
    spec = _requirements()[name].specifier
    assert spec.contains(Version(version), prereleases=True), f"{name} {spec} refuses {version}"
    if Version(version).is_prerelease:  # pip keeps an installed pre-release only if the range names one
        assert spec.contains(Version(version)), f"{name} {spec} admits {version} only with --pre"


def test_install_requires_are_ranges_not_pins():
    reqs = _requirements()
    assert set(reqs) == {"torch", "megatron-core", "pyyaml"}
    for r in reqs.values():
        assert not any(s.operator in ("==", "===", "~=") for s in r.specifier), f"{r} pins a version"


def test_extras_install_everywhere():
    extras = {k: {canonicalize_name(Requirement(r).name) for r in v} for k, v in _setup_kwargs()["extras_require"].items()}
    assert "gpu" not in extras
    gpu_only = {"apex", "transformer-engine", "transformer-engine-torch", "sglang", "flash-attn"}
    for name, reqs in extras.items():
        assert not reqs & gpu_only, f"extra {name!r} names {reqs & gpu_only}"
    assert extras["test"] >= {"pytest", "hypothesis", "matplotlib", "tensorboard", "wandb"}
    assert extras["plot"] == {"matplotlib"}
    assert extras["tensorboard"] == {"tensorboard"}
    assert extras["wandb"] == {"wandb"}


@pytest.mark.parametrize("path", _CONSTRAINTS)
def test_constraints_pin_versions_inside_the_ranges(path):
    pins = _pins(path)
    kwargs = _setup_kwargs()
    needed = {canonicalize_name(Requirement(r).name): Requirement(r)
              for r in kwargs["install_requires"] + kwargs["extras_require"]["test"]}
    assert set(needed) <= set(pins), f"{path} does not pin {set(needed) - set(pins)}"
    for name, req in needed.items():
        assert req.specifier.contains(Version(pins[name]), prereleases=True), f"{path}: {name}=={pins[name]} not in {req}"


def test_ci_installs_with_the_constraints():
    with open(os.path.join(_ROOT, ".ci", "run")) as f:
        ci = f.read()
    for path in _CONSTRAINTS:
        assert path in ci, f".ci/run does not use {path}"
    with open(os.path.join(_ROOT, "README.md")) as f:
        first_block = re.search(r"```bash\n(.*?)```", f.read(), flags=re.S).group(1).strip().splitlines()
    assert len(first_block) == 2, first_block  # one runs the main job, one runs the tests
    assert "constraints/ci-py311.txt" in first_block[1] and first_block[1] in ci.splitlines(), \
        "leg 1 of .ci/run is not the README's test command"
