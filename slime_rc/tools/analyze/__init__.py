"""``slime-rc analyze DUMP``: the mismatch report of a log-prob dump (:mod:`slime_rc.tools.dump`) and a recommended preset.

``DUMP`` is a JSONL file or a directory of ``step_*.jsonl`` files (``slime-rc train --dump-logprobs DIR``).  The dump
is streamed in chunks of whole samples; per chunk the engine (:func:`slime_rc.compute_rollout_correction`) runs once
for the analysis configuration and once per distinct preset, and the chunk totals are merged exactly
(:mod:`slime_rc.tools.analyze.accumulate`).  The recommendation automates rollout_corr_math.md §5.3
(:mod:`slime_rc.tools.analyze.guide`).  See docs/analyze.md.

Python: ``analyze(path) -> report`` (a dict: the engine's metric names at the top level, ``quantiles``, ``ess``,
``by_length``, ``by_probability``, ``presets``, ``recommended_preset``, ``reasons``, ``recommendation``),
``format_report(report)`` (text), ``report_json(report)`` (JSON-ready dict), ``plot_report(report, path)``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable, List, Optional

from slime_rc.tools.dump import iter_samples
from slime_rc.tools.analyze.accumulate import (CATASTROPHIC_RATIO, DEFAULT_CHUNK_TOKENS, LENGTH_EDGES, PROB_EDGES, DumpAnalysis,
                         MetricMerger, analysis_config, merge_rule)
from slime_rc.tools.analyze.plot import plot_report
from slime_rc.tools.analyze.guide import recommend
from slime_rc.tools.analyze.report import dumps as report_dumps, format_report, to_json as report_json

__all__ = ["analyze", "main", "build_parser", "format_report", "report_dumps", "report_json", "plot_report",
           "recommend", "DumpAnalysis", "MetricMerger", "analysis_config", "merge_rule", "DEFAULT_CHUNK_TOKENS",
           "CATASTROPHIC_RATIO", "LENGTH_EDGES", "PROB_EDGES"]


def analyze(path, *, steps: Optional[Iterable[int]] = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> dict:
    """Analyze the dump at ``path`` (a JSONL file or a ``step_*.jsonl`` directory; ``steps``: only these).

    Samples are packed into chunks of about ``chunk_tokens`` tokens (whole samples; at least one per chunk), so
    memory stays bounded by the chunk, whatever the dump's size.  Raises ``ValueError`` naming ``file:line`` for
    bad input (see :func:`slime_rc.tools.dump.iter_samples`).
    """
    if int(chunk_tokens) < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be >= 1")
    acc = DumpAnalysis()
    chunk, n = [], 0
    for sample in iter_samples(path, steps=steps):
        chunk.append(sample)
        n += len(sample)
        if n >= chunk_tokens:
            acc.add_chunk(chunk)
            chunk, n = [], 0
    acc.add_chunk(chunk)
    report = acc.finish()
    rec = recommend(report)
    report["recommended_preset"] = rec["recommended_preset"]
    report["reasons"] = rec["reasons"]
    report["recommendation"] = rec
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slime-rc analyze",
        description="Mismatch report of a log-prob dump (JSONL file or directory of step_*.jsonl): the engine's "
                    "metrics, IS weight quantiles and ESS, breakdowns by sample length and token probability, what "
                    "each preset would reject, and a recommended preset with its reasons. See docs/analyze.md.")
    p.add_argument("dump", metavar="DUMP", help="a .jsonl dump file or a directory of step_*.jsonl files")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="draw the log-ratio histogram and the breakdowns (matplotlib)")
    p.add_argument("--step", metavar="N", type=int, nargs="+", action="extend",
                   help="only these steps (a directory's step files, or the records' step key)")
    p.add_argument("--chunk-tokens", metavar="K", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help=f"stream the dump in chunks of about K tokens (default {DEFAULT_CHUNK_TOKENS})")
    return p


def _error(message: str) -> int:
    print(f"slime-rc analyze: error: {message}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # argparse already printed usage / help
        return int(e.code or 0)
    if args.chunk_tokens < 1:
        return _error(f"--chunk-tokens must be >= 1, got {args.chunk_tokens}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error("--plot needs matplotlib: pip install matplotlib (or pip install 'slime-rc[plot]')")
    try:
        report = analyze(args.dump, steps=args.step, chunk_tokens=args.chunk_tokens)
    except ValueError as e:
        return _error(str(e))
    except OSError as e:
        return _error(f"{args.dump}: {e.strerror or e}")
    if args.json:
        print(report_dumps(report))
    else:
        sys.stdout.write(format_report(report, args.dump))
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
