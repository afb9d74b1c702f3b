"""Every tensor the library creates follows its inputs' device: a scan of the source for tensor factories without
``device=`` (``torch.zeros(n)`` makes a CPU tensor even when the batch is on a GPU -- the hot path then fails, or
copies and stalls).  Scope: the package as a library (``slime_rc`` without the demo, the tools, the testing
helpers and the CLI) and ``custom_tis``.  A factory meant for the host (metadata, a message) says so on its line
with a ``# host:`` comment and a reason.  The engine, the losses and the slime surface also run whole on the
``meta`` device in their own tests (``tests/correction/test_host_reads.py`` and the hot-path tests)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "linspace", "logspace", "rand",
             "randn", "randint", "randperm", "eye", "scalar_tensor"}
NOT_LIBRARY = ("slime_rc/demo/", "slime_rc/tools/", "slime_rc/testing/", "slime_rc/cli.py", "slime_rc/__main__.py")


def library_files() -> List[Path]:
    files = sorted(ROOT.glob("slime_rc/**/*.py")) + sorted(ROOT.glob("custom_tis/*.py"))
    return [f for f in files if not str(f.relative_to(ROOT)).startswith(NOT_LIBRARY)]


def factories_without_device(path: Path) -> List[str]:
    source = path.read_text()
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        if any(k.arg == "device" for k in node.keywords) or any(k.arg is None for k in node.keywords):
            continue  # device= given (or **kwargs passed through)
        span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
        if any("# host:" in line for line in span):
            continue
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        out.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def test_scan_covers_the_library():
    names = {str(f.relative_to(ROOT)) for f in library_files()}
    for must in ("slime_rc/correction/engine.py", "slime_rc/losses.py", "slime_rc/megatron/loss.py", "slime_rc/slime/tis_bridge.py",
                 "slime_rc/slime/policy_loss.py", "slime_rc/slime/tis_contract.py", "slime_rc/slime/tis_hooks.py"):
        assert must in names
    assert not any(n.startswith("slime_rc/demo/") for n in names)


def test_the_scan_finds_a_factory_without_device(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\nx = torch.zeros(3)\ny = torch.zeros(3, device=x.device)\n"
                 "z = torch.tensor([1])  # host: a message\nw = torch.arange(4, dtype=torch.int64)\n")
    found = [line.split(": ", 1)[1] for line in factories_without_device(f)]
    assert found == ["x = torch.zeros(3)", "w = torch.arange(4, dtype=torch.int64)"]


def test_every_library_factory_names_its_device():
    offenders = [hit for f in library_files() for hit in factories_without_device(f)]
    assert not offenders, "tensor factories without device= (add device=..., or '# host: why'):\n" + "\n".join(
        offenders)
