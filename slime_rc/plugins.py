"""Load a user function from a spec string (e.g. slime's ``--custom-tis-function-path``).

Accepted forms:

* ``pkg.mod.fn``        -- import ``pkg.mod``, take ``fn`` (the last dot splits module from attribute);
* ``pkg.mod:fn``        -- same, explicit; ``pkg.mod:Class.method`` walks nested attributes;
* ``path/to/file.py:fn`` -- a file relative to the cwd or absolute.  A module of an importable package (e.g.
  ``custom_tis/mis.py``) is imported under its dotted name, so its relative imports work and it is the module
  ``custom_tis.mis.fn`` names; any other file is loaded under a module name unique to its absolute path (two
  ``plugin.py`` files in different folders don't collide; the same file loads once per process); its folder is not
  put on ``sys.path``, so it imports siblings only if they are importable anyway;
* ``mis`` / ``tis`` / ``icepop`` -- short names for the built-ins in :data:`SHORT_NAMES`.

slime's own loader (``slime.utils.misc.load_function``) accepts only the dotted ``pkg.mod.fn`` form: launch lines
meant for slime must use it (``custom_tis.mis.compute_mis_weights_with_cp``).

With ``contract=("k1", "k2", ...)`` the function must accept ``fn(args, k1=..., k2=...)``;
:data:`TIS_CONTRACT` is slime's custom TIS call, which returns ``(pg_loss, modified_masks, metrics)``.
Functions whose signature can't be inspected (some builtins) pass unchecked.

Every failure raises :class:`PluginError` (a ``ValueError``) whose message starts with the spec and says what
was tried: a malformed spec (lists the accepted forms); a module that isn't found; a module that is found but
raises while importing (original error included and chained); a missing ``.py`` file (absolute path); a
missing attribute (lists the public callables there and suggests the closest name); a non-callable (its
type); a contract the function can't take (the keywords it can't accept / required parameters not supplied,
and its signature).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Optional, Sequence

__all__ = ["PluginError", "SHORT_NAMES", "TIS_CONTRACT", "load_function", "check_contract"]

SHORT_NAMES = {
    "mis": "custom_tis.mis:compute_mis_weights_with_cp",
    "tis": "custom_tis.tis:compute_tis_weights_with_cp",
    "icepop": "custom_tis.icepop:compute_icepop_weights_with_cp",
}
TIS_CONTRACT = ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths",
                "response_lengths")
FORMS = "expected pkg.mod.fn, pkg.mod:fn, path/file.py:fn, or a short name (" + "/".join(SHORT_NAMES) + ")"


class PluginError(ValueError):
    """A plugin spec that can't be resolved to a usable function."""


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _parse(spec: str):
    """``(kind, target, attr_path)``, kind "file" (target is a path) or "module"; None if malformed."""
    if ":" in spec:
        target, _, attr = spec.rpartition(":")  # rpartition keeps Windows drive letters in the path
        if _dotted(attr) and (target.endswith(".py") or _dotted(target)):
            return ("file" if target.endswith(".py") else "module"), target, attr
    elif "/" not in spec and not spec.endswith(".py"):
        target, _, attr = spec.rpartition(".")
        if _dotted(target) and attr.isidentifier():
            return "module", target, attr
    return None


def _import_module(spec: str, name: str, dotted_form: bool):
    try:
        return importlib.import_module(name)
    except Exception as e:
        missing = e.name if isinstance(e, ModuleNotFoundError) else None
        if missing and (name == missing or name.startswith(missing + ".")):  # not a dependency of `name`
            hint = " (in pkg.mod.fn the last dot splits module from function)" if dotted_form else ""
            raise PluginError(f"{spec}: tried importing module {name!r}{hint}: no module named {missing!r}") from e
        raise PluginError(f"{spec}: module {name!r} was found but importing it failed: "
                          f"{type(e).__name__}: {e}") from e


def _package_module(path: str):
    """The module ``path`` already is under its importable dotted name (``custom_tis/mis.py`` -> ``custom_tis.mis``),
    so that its relative imports work and it is the same object slime's dotted path loads; None otherwise."""
    parts = [os.path.splitext(os.path.basename(path))[0]]
    folder = os.path.dirname(path)
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        parts.insert(0, os.path.basename(folder))
        folder = os.path.dirname(folder)
    if len(parts) == 1 or not all(p.isidentifier() for p in parts):
        return None
    name = ".".join(parts)
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    if origin and os.path.isfile(origin) and os.path.samefile(origin, path):
        return importlib.import_module(name)
    return None


def _load_file(spec: str, path: str):
    if not os.path.isfile(path):
        raise PluginError(f"{spec}: plugin file {path} not found")
    module = _package_module(path)
    if module is not None:
        return module
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"_slime_rc_plugin_{hashlib.sha1(path.encode()).hexdigest()[:12]}_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # so dataclasses / pickling inside the file can find it
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise PluginError(f"{spec}: file {path} was found but importing it failed: {type(e).__name__}: {e}") from e
    return module


def _get_attr(spec: str, obj: Any, attr_path: str, where: str):
    done = []
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            # list what the module defines, not what it merely imports
            own = [n for n in public if getattr(getattr(obj, n), "__module__", None) == getattr(obj, "__name__", 0)]
            public = own or public
            close = difflib.get_close_matches(part, public, n=1)
            owner = f"{where}:{'.'.join(done)}" if done else where
            raise PluginError(f"{spec}: {owner} has no attribute {part!r}"
                              + (f" (did you mean {close[0]!r}?)" if close else "")
                              + f". Public callables there: {', '.join(public) or '(none)'}")
        obj = getattr(obj, part)
        done.append(part)
    return obj


def check_contract(fn: Callable, contract: Sequence[str], spec: str = "") -> None:
    """Raise :class:`PluginError` unless ``fn(args, **{k: ... for k in contract})`` binds."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # e.g. builtins without signature metadata
    try:
        sig.bind(object(), **{k: None for k in contract})
        return
    except TypeError as e:
        bind_error = str(e)
    params, P = sig.parameters, inspect.Parameter
    var_kw = any(p.kind is P.VAR_KEYWORD for p in params.values())
    positional = [p for p in params.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    slot = positional[0].name if positional else None  # the parameter that receives ``args``
    keywordable = {n for n, p in params.items() if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    problems = []
    if slot is None and not any(p.kind is P.VAR_POSITIONAL for p in params.values()):
        problems.append("takes no positional parameter for args")
    unaccepted = [k for k in contract if k not in keywordable and not var_kw]
    if unaccepted:
        problems.append(f"does not accept keyword(s) {', '.join(unaccepted)}")
    if slot in contract and slot in keywordable:
        problems.append(f"its first parameter {slot!r} (which receives args) is also a contract keyword")
    required = [n for n, p in params.items() if p.default is P.empty and n != slot
                and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and not (n in contract and n in keywordable)]
    if required:
        problems.append(f"requires parameter(s) {', '.join(required)} that the contract does not supply")
    name = getattr(fn, "__qualname__", repr(fn))
    raise PluginError(f"{spec or name}: {name}{sig} cannot be called as fn(args, "
                      f"{', '.join(k + '=...' for k in contract)}): {'; '.join(problems) or bind_error}")


def load_function(spec: str, *, contract: Optional[Sequence[str]] = None) -> Callable:
    """Resolve ``spec`` (see the module docstring) to a callable, checking ``contract`` if given."""
    if not isinstance(spec, str):
        raise PluginError(f"{spec!r}: plugin spec must be a string; {FORMS}")
    resolved = SHORT_NAMES.get(spec.strip(), spec.strip())
    parsed = _parse(resolved)
    if parsed is None:
        raise PluginError(f"{spec or repr(spec)}: malformed plugin spec; {FORMS}")
    kind, target, attr_path = parsed
    if kind == "file":
        path = os.path.abspath(os.path.expanduser(target))
        module, where = _load_file(spec, path), f"file {path}"
    else:
        module, where = _import_module(spec, target, ":" not in resolved), f"module {target}"
    fn = _get_attr(spec, module, attr_path, where)
    if not callable(fn):
        raise PluginError(f"{spec}: {attr_path} in {where} is not callable (it is a {type(fn).__qualname__})")
    if contract is not None:
        check_contract(fn, contract, spec)
    return fn
