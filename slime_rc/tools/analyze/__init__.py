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
import os
import sys
from typing import Iterable, List, Optional

from slime_rc.tools.dump import FLOOR_LOG_PROB, iter_samples
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
    d = report["dump"]
    if d["valid_tokens"] == 0:  # every metric would be an empty mean (0): refuse rather than report "negligible"
        skipped = d.get("skipped_floor_tokens", 0)
        sel = "" if steps is None else " of the selected step(s)"
        if skipped:
            what = (f"none of the {d['response_tokens']} response token(s) of {d['samples']} sample(s){sel} is a loss "
                    f"token with a usable log-prob ({skipped} loss token(s) hold a log-prob at the float floor "
                    f"(<= {FLOOR_LOG_PROB:g}, a stand-in for -inf; first in {d['first_floor_sample']}) and were "
                    f"skipped)")
        elif d["response_tokens"]:
            what = (f"none of the {d['response_tokens']} response token(s) of {d['samples']} sample(s){sel} is a loss "
                    f"token (loss_mask is 0 on every token)")
        else:
            what = f"the {d['samples']} sample(s){sel} hold no response token (empty token arrays)"
        raise ValueError(f"{os.fspath(path)}: nothing to analyze: {what}; dump the trained tokens with loss_mask 1")
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


def _plot_path_error(plot: str, dump: str) -> Optional[str]:
    """Why ``--plot plot`` cannot be written (checked before the analysis, which may take minutes), else None."""
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    if os.path.isdir(plot):
        return f"--plot {plot} is a directory; give a file name, e.g. --plot {os.path.join(plot, 'mismatch.png')}"
    ext = os.path.splitext(plot)[1].lower().lstrip(".")
    if not ext:
        return f"--plot {plot} has no file extension; name the image file, e.g. --plot {plot}.png"
    if ext not in formats:
        return (f"--plot {plot}: '.{ext}' is not an image format matplotlib writes; use .png, .pdf or .svg "
                f"(supported: {', '.join(sorted(formats))})")
    parent = os.path.dirname(os.path.abspath(plot))
    if not os.path.isdir(parent):
        return f"--plot {plot}: directory {parent} does not exist; create it first (mkdir -p {parent})"
    if not os.access(parent, os.W_OK):
        return f"--plot {plot}: directory {parent} is not writable"
    if os.path.exists(plot) and os.path.exists(dump) and os.path.samefile(plot, dump):
        return f"--plot {plot} is the dump itself; writing the figure would destroy it: choose another file"
    return None


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
        problem = _plot_path_error(args.plot, args.dump)
        if problem:
            return _error(problem)
    try:
        report = analyze(args.dump, steps=args.step, chunk_tokens=args.chunk_tokens)
    except ValueError as e:
        return _error(str(e))
    except OSError as e:
        return _error(f"{e.filename or args.dump}: {e.strerror or e}")
    if args.json:
        print(report_dumps(report))
    else:
        sys.stdout.write(format_report(report, args.dump))
    if args.plot:
        existed = os.path.exists(args.plot)
        try:
            plot_report(report, args.plot)
        except OSError as e:
            return _error(f"--plot {args.plot}: cannot write the figure ({e.strerror or e})")
        print(f"wrote {args.plot}" + (" (replaced the existing file)" if existed else ""),
              file=sys.stderr if args.json else sys.stdout)
    return 0
