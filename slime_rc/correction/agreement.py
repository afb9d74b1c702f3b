"""What the ranks of a correction call must agree on, and the message when they do not (host-side, no collectives).

Ranks launched with different settings, or context-parallel peers holding different numbers of sequences, used
to meet in a collective of mismatched sizes (gloo: ``Received data size doesn't match expected size``; NCCL: a
hang) or, worse, of matching sizes, silently adding statistics computed under two IS caps.  Before its first
collective, each call therefore exchanges one fixed-size header per rank (:meth:`DistributedReducer.agree
<slime_rc.correction.reducer.DistributedReducer.agree>`)::

    [protocol, settings fingerprint, sequences on this rank, sequence-group key, global rank]

and every rank checks every header with :func:`disagreement`, so all of them raise the same ``ValueError`` or
none does.  The fingerprint covers every setting (hence the statistic columns, which depend on the settings
only); the protocol word covers the library version (a rank running other code would lay out its columns
differently).  Only on a mismatch are the settings themselves gathered, to name the keys that differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from typing import Any, Dict, List, Optional, Sequence

HEADER_WORDS = 5
PROTOCOL, FINGERPRINT, SEQUENCES, SEQUENCE_KEY, RANK = range(HEADER_WORDS)

_FINGERPRINTS: Dict[Any, int] = {}


def _int64(text: str) -> int:
    """A stable signed 64-bit hash of ``text`` (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _version() -> str:
    try:
        return importlib.metadata.version("slime-rc")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


_PROTOCOL = _int64(f"slime-rc rank agreement 1 / {_version()}")


def protocol_word() -> int:
    return _PROTOCOL


def settings_dict(settings: Any) -> Dict[str, Any]:
    """The settings as plain values: ``to_dict()`` when it has one, a dataclass's fields, else its ``repr``."""
    if hasattr(settings, "to_dict"):
        return settings.to_dict()
    if dataclasses.is_dataclass(settings):
        return dataclasses.asdict(settings)
    return {"settings": repr(settings)}


def fingerprint(settings: Any) -> int:
    """A stable 64-bit fingerprint of every setting (cached per settings object: configs are frozen)."""
    try:
        return _FINGERPRINTS[settings]
    except (KeyError, TypeError):
        pass
    value = _int64(json.dumps(settings_dict(settings), sort_keys=True, default=repr))
    try:
        if len(_FINGERPRINTS) >= 256:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[settings] = value
    except TypeError:  # an unhashable settings object is fingerprinted at every call
        pass
    return value


def header(settings: Any, n_sequences: int, sequence_key: int, rank: int) -> List[int]:
    return [protocol_word(), fingerprint(settings), int(n_sequences), int(sequence_key), int(rank)]


def _ranks(ranks: Sequence[int]) -> str:
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def disagreement(what: str, headers: Sequence[Sequence[int]],
                 settings_of: Optional[Sequence[Dict[str, Any]]] = None) -> Optional[str]:
    """The message naming which ranks differ and in what, or None when the headers agree.

    ``headers``: one :data:`HEADER_WORDS` list per rank of the batch group, in group order (the same on every
    rank).  ``settings_of``: each rank's :func:`settings_dict`, gathered only after a fingerprint mismatch."""
    problems = []
    by_protocol: Dict[int, List[int]] = {}
    by_fingerprint: Dict[int, List[int]] = {}
    for h in headers:
        by_protocol.setdefault(h[PROTOCOL], []).append(h[RANK])
        by_fingerprint.setdefault(h[FINGERPRINT], []).append(h[RANK])
    if len(by_protocol) > 1:
        groups = "; ".join(_ranks(r) for r in by_protocol.values())
        problems.append(f"different slime-rc versions ({groups}): install the same slime-rc on every node")
    elif len(by_fingerprint) > 1:
        problems.append("different settings: " + _settings_difference(headers, settings_of)
                        + "; launch every rank with the same rollout-correction flags / YAML (a per-node config "
                          "file or environment that differs is the usual cause)")
    by_group: Dict[int, List[Sequence[int]]] = {}
    for h in headers:
        by_group.setdefault(h[SEQUENCE_KEY], []).append(h)
    uneven = ["; ".join(f"rank {h[RANK]} holds {h[SEQUENCES]}" for h in peers) for peers in by_group.values()
              if len({h[SEQUENCES] for h in peers}) > 1]
    if uneven:
        problems.append("context-parallel peers hold different numbers of sequences (" + " | ".join(uneven)
                        + "): the ranks of a CP group hold pieces of the same sequences, so split each sequence "
                          "over them (slime_rc.megatron.cp_layout), never the batch")
    if not problems:
        return None
    return (f"{what}: the ranks disagree before their first collective, so nothing was reduced: "
            + "; and ".join(problems))


def _settings_difference(headers: Sequence[Sequence[int]], settings_of: Optional[Sequence[Dict[str, Any]]]) -> str:
    if settings_of is None:
        groups = {}
        for h in headers:
            groups.setdefault(h[FINGERPRINT], []).append(h[RANK])
        return " vs ".join(_ranks(r) for r in groups.values())
    keys = sorted({k for d in settings_of for k in d})
    parts = []
    for key in keys:
        values: Dict[str, List[int]] = {}
        for h, d in zip(headers, settings_of):
            values.setdefault(repr(d.get(key, "<unset>")), []).append(h[RANK])
        if len(values) > 1:
            parts.append(f"{key}: " + ", ".join(f"{_ranks(r)} {'have' if len(r) > 1 else 'has'} {v}"
                                                for v, r in values.items()))
    return "; ".join(parts) if parts else "the same values but different fingerprints (report this as a bug)"
