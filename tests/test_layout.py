"""The layout is the architecture: which folder may import which, read from the source (every ``import``, lazy ones
inside functions included) so that an arrow running back up fails here, named.

Layers, bottom to top (a module may import its own layer and those below, never above)::

    config, plugins                  what the user sets (knob table, flags, YAML, presets) and TIS-function loading
    correction                       the correction engine over packed tensors (torch.distributed: reducer.py only)
    losses, diffusion, sglang_output the policy losses, FlowGRPO's layout, SGLang's output read as tensors
    megatron                         what runs inside a Megatron job (vocab-parallel log-probs, the zigzag, the
                                     reducers over parallel_state, the loss); the only layer that imports megatron
    slime                            THE slime integration: its args reader and settings, its batch (tis_contract),
                                     the custom loss, the TIS functions (tis_hooks), slime's semantics on its keys
    custom_tis, testing              re-exports of the TIS functions under the paths slime loads; the test reference
    tools                            offline: analyze, dump, estimator study
    demo                             the CPU demo trainer: tiny model, CPU patches, CP attention, rollout engines
    cli                              the command line
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Dict, List, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYERS = [
    ("slime_rc.config", "slime_rc.plugins"),
    ("slime_rc.correction",),
    ("slime_rc.losses", "slime_rc.diffusion", "slime_rc.sglang_output"),
    ("slime_rc.megatron",),
    ("slime_rc.slime",),
    ("custom_tis", "slime_rc.testing"),
    ("slime_rc.tools",),
    ("slime_rc.demo",),
    ("slime_rc.cli", "slime_rc.__main__"),
]
LIBRARY_TOP = 5          # layers below this index are the library proper
# the one module of the library that talks to other ranks
DISTRIBUTED_ALLOWED = {"slime_rc.correction.reducer"}


def _modules(top: str) -> Dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


MODULES = {**_modules("slime_rc"), **_modules("custom_tis")}


def _imports(name: str, path: str) -> Set[str]:
    """Every module (of ours, or ``torch.distributed``) that ``name`` imports anywhere in its source."""
    is_package = path.endswith("__init__.py")
    out: Set[str] = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[:None if is_package else -1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            if t in MODULES or t.startswith("torch.distributed"):
                out.add("torch.distributed" if t.startswith("torch.distributed") else t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return -1


def test_every_module_has_a_layer():
    homeless = sorted(m for m in MODULES if m not in ("slime_rc",) and _layer(m) < 0)
    assert not homeless, f"modules outside every layer of tests/test_layout.py: {homeless}"


def test_no_import_runs_back_up():
    upward = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
              for m, targets in GRAPH.items() for t in targets
              if t in MODULES and m != "slime_rc" and t != "slime_rc" and _layer(t) > _layer(m)]
    assert not upward, "imports that run back up:\n" + "\n".join(sorted(upward))


def test_library_never_imports_tools_demo_testing_or_cli():
    library = [m for m in MODULES if 0 <= _layer(m) < LIBRARY_TOP] + ["slime_rc"]
    bad = [f"{m} imports {t}" for m in library for t in GRAPH[m] if _layer(t) >= LIBRARY_TOP]
    assert not bad, bad


def test_package_modules_do_not_import_the_package_itself():
    # ``from slime_rc import X`` inside the package makes the public API an arrow back into every module
    bad = [m for m, targets in GRAPH.items() if m.startswith("slime_rc.") and "slime_rc" in targets]
    assert not bad, f"import the defining submodule instead of the package: {bad}"


def test_torch_distributed_only_in_the_reducer_and_the_demo():
    users = {m for m, targets in GRAPH.items() if "torch.distributed" in targets}
    outside = sorted(m for m in users if m not in DISTRIBUTED_ALLOWED and not m.startswith("slime_rc.demo."))
    assert not outside, f"torch.distributed outside slime_rc/correction/reducer.py (and the demo): {outside}"
    assert DISTRIBUTED_ALLOWED <= users


def _cycle() -> List[str]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(m: str) -> List[str]:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH.get(m, ())):
            if t not in MODULES:
                continue
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(MODULES):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_no_import_circle():
    cycle = _cycle()
    assert not cycle, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("bench", sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py")))
def test_benchmarks_import_only_the_package(bench):
    tree = ast.parse(open(os.path.join(ROOT, "benchmarks", bench)).read())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {n for n in names if n == "tests" or n.startswith("tests.")}, f"{bench} imports the test suite"


def test_importing_the_library_and_the_slime_surface_leaves_dynamo_unimported():
    """``torch._dynamo`` is ~1.1 s of import: a process that never compiles nor reduces across ranks (the CLI, a
    launch refused at its first check, slime loading ``custom_tis``) does not pay it (``reducer.py`` makes its
    collectives opaque to ``torch.compile`` at its first distributed instance, not at import)."""
    code = ("import sys, slime_rc, slime_rc.cli, custom_tis.mis, custom_tis.tis, slime_rc.slime.policy_loss\n"
            "from slime_rc.correction.reducer import DistributedReducer, LocalReducer\n"
            "print(sorted(m for m in sys.modules if m == 'torch._dynamo' or m.startswith('torch._dynamo.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def _megatron_imports(path: str) -> Set[str]:
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
    return {n for n in names if n == "megatron" or n.startswith("megatron.") or n.startswith("slime_rc.megatron")}


def test_only_the_megatron_integration_and_above_import_megatron():
    """The engine (config, correction, losses) knows process groups, not Megatron: megatron-core's parallel_state
    is read by slime_rc.megatron (its reducers) and the layers above it."""
    below = [m for m in MODULES if 0 <= _layer(m) < _layer("slime_rc.megatron")]
    bad = {m: sorted(_megatron_imports(MODULES[m])) for m in below if _megatron_imports(MODULES[m])}
    assert not bad, f"modules below slime_rc.megatron that import Megatron: {bad}"
    assert _megatron_imports(MODULES["slime_rc.megatron.reducers"])  # the check reads what it should


def test_custom_tis_only_re_exports_the_one_slime_integration():
    """What slime loads by path (custom_tis.<module>.<function>) is the slime integration's function itself: each
    custom_tis module imports from slime_rc.slime.tis_hooks and defines nothing."""
    for name, path in MODULES.items():
        if not name.startswith("custom_tis"):
            continue
        tree = ast.parse(open(path).read(), path)
        defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
        assert not defined, f"{name} defines {defined}: the functions live in slime_rc.slime.tis_hooks"
        ours = {t for t in GRAPH[name] if t in MODULES and not t.startswith("custom_tis")}
        assert ours <= {"slime_rc.slime.tis_hooks"}, f"{name} imports {sorted(ours)}"
