"""The log-prob dump: per-sample train / rollout log-probs as JSONL, for ``slime-rc analyze`` (never pickle).

One sample per line, a JSON object::

    {"train_log_probs": [-0.12, -3.5, ...],   # [T] log pi_train of each response token (pi_old, or pi_theta in bypass)
     "rollout_log_probs": [-0.11, -3.9, ...], # [T] log pi_rollout of the same tokens
     "loss_mask": [1, 1, 0, ...],             # [T] 0/1: 0 marks tool / padding tokens that are not trained on
     "response_length": 3,                    # optional: T
     "turn_ids": [0, 0, 1, ...],              # optional: [T] ints, the turn of each token (multi-turn / agents)
     "step": 12, "sample": 5, "reward": 1.0, "advantage": 0.7, "mode": "decoupled"}   # optional free keys

The three token arrays cover the response tokens of one sample and have equal length ``T``.  Floats are written
with Python's shortest round-trip ``repr``, so float32 (and float64) values read back bit-exactly.  Non-finite
log-probs are written as ``null`` (as SGLang does; JSON has no NaN) and refused by the reader on loss tokens.

A dump is one ``.jsonl`` file or a directory of ``step_{step:06d}.jsonl`` files written by :class:`DumpWriter`
(atomically: a reader never sees half a step).  :func:`iter_samples` streams either, one line at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch

REQUIRED_KEYS = ("train_log_probs", "rollout_log_probs", "loss_mask")
TOKEN_KEYS = REQUIRED_KEYS + ("turn_ids",)
# A log-prob above this is not a log-prob (logits? probabilities?); the slack admits rounding of log(1) ~ 0.
MAX_LOG_PROB = 1e-4
# A log-prob at or below this is a float floor standing in for -inf (float32 min -3.4028235e38, bf16 min -3.39e38:
# what SGLang / a log_softmax writes for a token it gives no probability), not a measurement.  ``slime-rc analyze``
# skips such loss tokens and counts them (docs/analyze.md); -1e4 is kept (a real, catastrophic ratio).
FLOOR_LOG_PROB = -1e30
# The first bytes of files that are not JSONL text: what they are, and what to do.
_BINARY_MAGIC = ((b"\x1f\x8b", "a gzip file: decompress it first (gunzip {file})"),
                 (b"PK\x03\x04", "a zip archive (torch.save writes these): a dump is JSONL text; write one with "
                                  "slime_rc.tools.dump.sample_record + DumpWriter, or slime-rc train "
                                  "--dump-logprobs DIR"),
                 (b"\x80", "a pickle (torch.save / pickle.dump): a dump is JSONL text, never pickle; write one with "
                           "slime_rc.tools.dump.sample_record + DumpWriter, or slime-rc train --dump-logprobs DIR"),
                 (b"\x93NUMPY", "a numpy .npy file: a dump is JSONL text; write one with "
                                "slime_rc.tools.dump.sample_record + DumpWriter"))
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read the process umask once (os.umask can only be read by setting it)
STEP_FILE = re.compile(r"^step_(\d+)(?:\.[^/]*)?\.jsonl$")  # step_000012.jsonl (and step_000012.<tag>.jsonl)


# ---- writing ------------------------------------------------------------------------------------------------------
def _float_list(name: str, x) -> List[Optional[float]]:
    """A 1-D float sequence as JSON-ready floats; NaN/inf become None (JSON null)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D (the response tokens of one sample), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            t = t.double()
        elif t.dtype in (torch.float16, torch.bfloat16):
            t = t.float()  # exact: every bf16/fp16 value is a float32 value
        t = t.cpu()
        values = t.tolist()  # float32 -> Python float is exact; repr() then round-trips it
        if bool(torch.isfinite(t).all()):
            return values
    else:
        values = [None if v is None else float(v) for v in x]
    return [v if v is not None and math.isfinite(v) else None for v in values]


def _mask_list(x) -> List[int]:
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(list(x), dtype=torch.float64)
    if t.dim() != 1:
        raise ValueError(f"loss_mask must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype != torch.bool and bool(((t != 0) & (t != 1)).any()):
        raise ValueError("loss_mask must hold only 0 and 1")
    return (t != 0).to(torch.int64).tolist()


def _jsonable(value: Any) -> Any:
    """Tensors / numpy values / non-finite floats of an extra field as JSON values."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.dim() == 0 else value.tolist()
    elif hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays and scalars
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def sample_record(train_log_probs, rollout_log_probs, loss_mask, **extra) -> dict:
    """One dump record: ``train_log_probs`` / ``rollout_log_probs`` (``[T]`` tensors or sequences of floats),
    ``loss_mask`` (``[T]`` 0/1 or bool) and free ``extra`` keys (``step``, ``sample``, ``reward``, ``mode``,
    ``response_length``, ``turn_ids`` ``[T]`` ...), converted to JSON-ready lists and numbers.

    Raises ``ValueError`` when the arrays are not 1-D, differ in length or the mask is not 0/1 — a dump that the
    reader would refuse is better refused when it is written.  Non-finite log-probs are kept (as ``null``): the
    reader names them.
    """
    record = {"train_log_probs": _float_list("train_log_probs", train_log_probs),
              "rollout_log_probs": _float_list("rollout_log_probs", rollout_log_probs),
              "loss_mask": _mask_list(loss_mask)}
    for key, value in extra.items():
        record[key] = _jsonable(value)
    lengths = {k: len(record[k]) for k in REQUIRED_KEYS}
    if "turn_ids" in record and record["turn_ids"] is not None:
        lengths["turn_ids"] = len(record["turn_ids"])
    if len(set(lengths.values())) > 1:
        raise ValueError(f"sample_record: the token arrays differ in length: {lengths}")
    return record


def _dumps(record: dict) -> str:
    try:
        return json.dumps(record, separators=(",", ":"), allow_nan=False, default=_jsonable)
    except ValueError:  # a NaN/inf float somewhere in a hand-made record: write it as null
        return json.dumps(_jsonable(record), separators=(",", ":"), allow_nan=False)


class DumpWriter:
    """Writes one JSONL file per step into ``directory`` (created if missing)."""

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step_{int(step):06d}.jsonl")

    def write_step(self, step: int, records: Iterable[dict]) -> str:
        """Write ``records`` (dicts, e.g. from :func:`sample_record`) to ``directory/step_{step:06d}.jsonl``
        and return its path.  Atomic: the lines go to a hidden temporary file in the same directory that
        ``os.replace`` renames over the target, so a reader (or a crash) never sees a partial step."""
        path = self.path(step)
        fd, tmp = tempfile.mkstemp(prefix=f".step_{int(step):06d}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # mkstemp makes 0600; a dump is a plain file
                for n, record in enumerate(records):
                    missing = [k for k in REQUIRED_KEYS if k not in record]
                    if missing:
                        raise ValueError(f"DumpWriter.write_step({step}): record {n} lacks {', '.join(missing)}; "
                                         f"build records with slime_rc.tools.dump.sample_record")
                    f.write(_dumps(record))
                    f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path


# ---- reading ------------------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One record read back.  Token tensors are ``[T]``: ``train_log_probs`` / ``rollout_log_probs`` float32
    (NaN where a masked token held null/NaN/inf: the engine ignores masked tokens), ``loss_mask`` bool,
    ``turn_ids`` int64 or None.  ``extra`` holds every other key of the record; ``path:line`` is where it is."""

    path: str
    line: int
    train_log_probs: torch.Tensor
    rollout_log_probs: torch.Tensor
    loss_mask: torch.Tensor
    turn_ids: Optional[torch.Tensor] = None
    file_step: Optional[int] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def step(self) -> Optional[int]:
        """The step of the file it came from (``step_N.jsonl``), else the record's ``step`` key."""
        if self.file_step is not None:
            return self.file_step
        step = self.extra.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    def __len__(self) -> int:
        return self.loss_mask.numel()


def _describe(value) -> str:
    if value is None:
        return "null (NaN/inf are written as null)"
    return repr(value)


def _number_tensor(where: str, key: str, values, dtype) -> torch.Tensor:
    """``values`` (a JSON list) as a ``dtype`` tensor, null -> NaN; a clear error names the first bad entry."""
    if not isinstance(values, list):
        raise ValueError(f"{where}: {key!r} must be a list of numbers, got {type(values).__name__}")
    try:
        t = torch.tensor(values, dtype=dtype)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        pass
    else:
        if t.dim() != 1:
            raise ValueError(f"{where}: {key!r} must be a flat list (one number per response token of this sample), "
                             f"got nested lists of shape {list(t.shape)}; write one record per sample")
        return t
    out = []
    for i, v in enumerate(values):
        if v is None and dtype.is_floating_point:
            out.append(math.nan)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) or isinstance(v, bool) and key == "loss_mask":
            out.append(v)
        else:
            raise ValueError(f"{where}: {key!r}[{i}] is {_describe(v)}, not a number")
    try:
        return torch.tensor(out, dtype=dtype)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"{where}: {key!r} holds a value that is not a valid number ({e})") from None


def parse_record(record: Any, where: str) -> Dict[str, Any]:
    """Validate one decoded record; returns the tensors and the extra keys (see :class:`Sample`).

    Refuses (``ValueError`` starting with ``where`` = ``file:line``): a record that is not an object, a missing
    key, nested (2-D) token arrays, arrays of different lengths, a mask value other than 0/1, null/NaN/inf on a
    loss token, a log-prob above :data:`MAX_LOG_PROB`, ``response_length`` different from the token count,
    ``turn_ids`` that are not ints.
    """
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a dump record must be a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r} (a dump record needs {', '.join(REQUIRED_KEYS)})")
    mask = _number_tensor(where, "loss_mask", record["loss_mask"], torch.float64)
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"{where}: 'loss_mask'[{i}] = {json.dumps(record['loss_mask'][i])} is not 0 or 1")
    mask = mask != 0
    n = mask.numel()
    tensors = {}
    for key in ("train_log_probs", "rollout_log_probs"):
        values = _number_tensor(where, key, record[key], torch.float64)
        if values.numel() != n:
            raise ValueError(f"{where}: lengths differ: {key!r} has {values.numel()} tokens, 'loss_mask' has {n}")
        values32 = values.float()  # what the engine computes with
        nonfinite = ~torch.isfinite(values32) & mask
        if bool(nonfinite.any()):
            i = int(torch.nonzero(nonfinite)[0, 0])
            what = _describe(record[key][i]) + (" (beyond float32)" if math.isfinite(values[i]) else "")
            raise ValueError(f"{where}: {key!r}[{i}] is {what} on a loss token (token {i}; "
                             f"{int(nonfinite.sum())} such token(s) in this sample); fix the log-prob source")
        positive = values > MAX_LOG_PROB  # NaN compares False
        if bool(positive.any()):
            i = int(torch.nonzero(positive)[0, 0])
            raise ValueError(f"{where}: {key!r}[{i}] = {float(values[i])!r} at token {i} is a positive log-prob "
                             f"(> {MAX_LOG_PROB:g}); log-probs are <= 0 (logits or probabilities written by mistake?)")
        tensors[key] = values32
    turn_ids = None
    if record.get("turn_ids") is not None:
        turn_ids = _number_tensor(where, "turn_ids", record["turn_ids"], torch.float64)
        if turn_ids.numel() != n:
            raise ValueError(f"{where}: lengths differ: 'turn_ids' has {turn_ids.numel()} tokens, 'loss_mask' has {n}")
        if not bool((turn_ids == turn_ids.round()).all()):
            raise ValueError(f"{where}: 'turn_ids' must hold integers")
        turn_ids = turn_ids.long()
    length = record.get("response_length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length != n):
        raise ValueError(f"{where}: 'response_length' = {length!r} but the token arrays hold {n} tokens")
    extra = {k: v for k, v in record.items() if k not in TOKEN_KEYS}
    return dict(train_log_probs=tensors["train_log_probs"], rollout_log_probs=tensors["rollout_log_probs"],
                loss_mask=mask, turn_ids=turn_ids, extra=extra)


def dump_files(path, steps: Optional[Iterable[int]] = None) -> List[tuple]:
    """``[(file, step or None)]`` of a dump: the file itself, or a directory's ``step_*.jsonl`` sorted by step
    (restricted to ``steps`` when given).  ``ValueError`` if the path is missing or holds no step file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        found = []
        try:
            names = os.listdir(path)
        except OSError as e:
            raise ValueError(f"{path}: cannot list the dump directory ({e.strerror}); check its permissions "
                             f"(chmod +rx {path})") from None
        for name in names:
            m = STEP_FILE.match(name)
            if m and os.path.isfile(os.path.join(path, name)):
                found.append((int(m.group(1)), name))
        if not found:
            others = sorted(n for n in names if n.endswith(".jsonl") and os.path.isfile(os.path.join(path, n)))
            if others:
                shown = ", ".join(others[:3]) + (f" (+{len(others) - 3} more)" if len(others) > 3 else "")
                raise ValueError(f"{path}: no step_*.jsonl file in the dump directory, but {len(others)} other .jsonl "
                                 f"file(s): {shown}; pass one file (slime-rc analyze {os.path.join(path, others[0])}) "
                                 f"or name them step_NNNNNN.jsonl")
            raise ValueError(f"{path}: empty dump directory (no step_*.jsonl files)")
        found.sort()
        by_step: Dict[int, List[str]] = {}
        for s, n in found:
            by_step.setdefault(s, []).append(n)
        for s, ns in by_step.items():
            plain = [n for n in ns if n.count(".") == 1]  # step_N.jsonl, not a tagged shard step_N.<tag>.jsonl
            if len(ns) > 1 and plain:
                raise ValueError(f"{path}: step {s} is in {len(ns)} files ({', '.join(ns)}): dumps of different runs "
                                 f"mixed in one directory? keep one run per directory, or analyze one file")
        if steps is not None:
            wanted = set(steps)
            chosen = [(s, n) for s, n in found if s in wanted]
            if not chosen:
                raise ValueError(f"{path}: no step file for step(s) {sorted(wanted)}; the dump has steps "
                                 f"{step_ranges(sorted({s for s, _ in found}))}")
            found = chosen
        return [(os.path.join(path, n), s) for s, n in found]
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory")
    return [(path, None)]


def step_ranges(values: List[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ", ".join(parts)


def iter_samples(path, *, steps: Optional[Iterable[int]] = None) -> Iterator[Sample]:
    """Stream the samples of a dump (one JSONL file, or a directory of ``step_*.jsonl`` files in step order),
    one line in memory at a time.  ``steps``: only these steps (a directory's file steps; in a single file, the
    records' ``step`` key).  Blank lines are skipped.

    Raises ``ValueError`` naming ``file:line`` and the key for a bad record (see :func:`parse_record`) or a line
    that is not UTF-8 JSON (a truncated last line says so), and naming the path for an empty file, a binary file
    (gzip, ``torch.save`` zip, pickle, ``.npy``), an unreadable file, a directory without records or without
    ``step_*.jsonl`` files (the other ``.jsonl`` files are named), two files for one step of which one is a plain
    ``step_N.jsonl`` (two runs in one directory), or steps that select nothing.  The path is checked when this is
    called; records as they are read.
    """
    steps = None if steps is None else sorted({int(s) for s in steps})
    files = dump_files(path, steps)
    return _iter(os.fspath(path), files, steps)


def _iter(path: str, files: List[tuple], steps: Optional[List[int]]) -> Iterator[Sample]:
    yielded, records, seen_steps = 0, 0, set()
    for file, file_step in files:
        in_file = 0
        try:
            f = open(file, "rb")
        except OSError as e:
            raise ValueError(f"{file}: cannot read the dump file ({e.strerror}); check its permissions "
                             f"(chmod +r {file})") from None
        with f:
            head = f.read(8)
            for magic, what in _BINARY_MAGIC:
                if head.startswith(magic):
                    raise ValueError(f"{file}: not a JSONL dump but {what.format(file=file)}")
            f.seek(0)
            for line_no, raw in enumerate(f, 1):
                where = f"{file}:{line_no}"
                try:
                    line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a BOM is harmless
                except UnicodeDecodeError as e:
                    raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}): "
                                     f"a binary or corrupt file; a dump is JSONL text, one JSON object per line"
                                     ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))  # columns of an error at the end stay on this line
                except json.JSONDecodeError as e:
                    cut = "" if raw.endswith(b"\n") else ("; the file ends inside this line: truncated (a partial "
                                                          "copy or a crashed writer?); drop the last line")
                    raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno}){cut}") from None
                in_file += 1
                sample = Sample(path=file, line=line_no, file_step=file_step, **parse_record(record, where))
                step = sample.step
                seen_steps.add(step)
                if steps is not None and file_step is None and step not in steps:
                    continue
                yielded += 1
                yield sample
        if in_file == 0 and len(files) == 1 and file_step is None:
            raise ValueError(f"{file}: empty dump file (no records)")
        records += in_file
    if records == 0:
        raise ValueError(f"{path}: the dump holds no records ({len(files)} empty step file(s))")
    if yielded == 0:
        present = sorted(s for s in seen_steps if s is not None)
        raise ValueError(f"{path}: no sample of step(s) {steps}; records carry steps "
                         f"{step_ranges(present) if present else '(none: no step key)'}")
