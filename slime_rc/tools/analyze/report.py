"""The text and JSON forms of an analysis report."""

from __future__ import annotations

import json
import math
from typing import List

from slime_rc.tools.dump import step_ranges
from slime_rc.correction.metrics import METRICS
from slime_rc.correction.quantiles import QUANTILES

# The mismatch section: the engine's always-reported metrics, in reading order.
MISMATCH = ("k3_kl", "kl", "chi2_token", "chi2_seq", "train_rollout_logprob_abs_diff", "log_ppl_diff",
            "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "training_ppl", "rollout_ppl",
            "training_log_ppl", "rollout_log_ppl")


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # strict JSON; only float64 overflow can get here
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def to_json(report: dict) -> dict:
    """The report without its in-memory parts (histogram tensors), non-finite floats as None: JSON-ready."""
    return _finite({k: v for k, v in report.items() if not k.startswith("_")})


def dumps(report: dict) -> str:
    return json.dumps(to_json(report), indent=2, allow_nan=False)


def _g(x, digits=4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (x == 0 or 1e-3 <= abs(x) < 1e5):
        return f"{x:.{digits}g}"
    return f"{x:.{digits - 1}e}" if isinstance(x, float) else str(x)


def _pct(x) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.2f}%" if x == 0 or x >= 1e-3 else f"{100 * x:.2g}%"  # keep rare events visible


def _table(headers: List[str], rows: List[List[str]], indent: str = "  ", left=(0,)) -> List[str]:
    """Aligned columns: those in ``left`` (text) flush left, numbers flush right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: indent + "  ".join(c.ljust(w) if i in left else c.rjust(w)  # noqa: E731
                                            for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(headers)] + [line(r) for r in rows]


def format_report(report: dict, source: str = "") -> str:
    d = report["dump"]
    steps = step_ranges(d["steps"]) if d["steps"] else "-"
    out = [f"slime-rc analyze {source}".rstrip(),
           f"  {d['samples']} samples in {d['files']} file(s), steps {steps}; {d['response_tokens']} response tokens, "
           f"{d['loss_tokens']} loss tokens; mean length {d['mean_length']:.1f} loss tokens (max {d['max_length']})"
           + (f"; recorded in mode {', '.join(f'{m} ({n})' for m, n in d['modes'].items())}" if d["modes"] else ""),
           *([f"  skipped {d['skipped_floor_tokens']} loss token(s) in {d['skipped_floor_samples']} sample(s) "
              f"whose log-prob is at the float floor (<= -1e30, a stand-in for -inf; first in "
              f"{d['first_floor_sample']}): not in any number below"] if d.get("skipped_floor_tokens") else []),
           "  r = pi_train / pi_rollout (pi_train: pi_old, or pi_theta in bypass); log r clamped to ±20 before exp; "
           f"{d['chunks']} chunk(s) merged exactly", ""]

    out.append("Mismatch (token means over loss tokens, sequence means over samples)")
    out += _table(["metric", "value", "definition"],
                  [[n, _g(report[n]), METRICS[n][1]] for n in MISMATCH if n in report], left=(0, 2))
    out.append("")

    q = report["quantiles"]
    out.append("IS weight: the raw token ratio r")
    out.append("  " + "  ".join(f"p{round(x * 100)} {_g(q[f'p{round(x * 100)}'])}" for x in QUANTILES)
               + f"  min {_g(report.get('rollout_is_min'))}  max {_g(report.get('rollout_is_max'))}")
    tok = report["presets"].get("decoupled_token_is", {}).get("metrics", {})  # token ratio bounds [0.5, 2]
    outside = tok.get("rollout_is_ratio_fraction_high", 0.0) + tok.get("rollout_is_ratio_fraction_low", 0.0)
    out.append(f"  effective sample size of raw token weights {_g(report['ess'])} "
               f"(std {_g(report.get('rollout_is_std'))})"
               + (f"; tokens outside [0.5, 2]: {_pct(outside)}" if tok else ""))
    out.append(f"  catastrophic tokens (r < 1e-4): {report['catastrophic_tokens']} "
               f"({_pct(report.get('rollout_is_catastrophic_token_fraction'))} of tokens), in "
               f"{_pct(report.get('rollout_is_veto_fraction'))} of samples; k3_kl without them "
               f"{_g(report['k3_kl_excluding_catastrophic'])}")
    out.append("")

    out.append("By sample length (loss tokens)")
    out += _table(["length", "samples", "tokens", "kl", "k3_kl", "mean|log r|", "mean|S|", "|S|>=20", "chi2_seq"],
                  [[r["bucket"], str(r["samples"]), str(r["tokens"]), _g(r["kl"], 3), _g(r["k3_kl"], 3),
                    _g(r["mean_abs_log_ratio"], 3), _g(r["mean_abs_seq_log_ratio"], 3), _pct(r["seq_clamp_fraction"]),
                    _g(r["chi2_seq"], 3)] for r in report["by_length"]])
    out.append("  (S = sum_t log r of a sample: the log of its sequence IS weight)")
    out.append("")

    out.append("By rollout token probability")
    out += _table(["p_rollout", "tokens", "share", "samples", "kl", "k3_kl", "k3 share", "mean|log r|"],
                  [[r["bucket"], str(r["tokens"]), _pct(r["token_share"]), str(r["samples"]), _g(r["kl"], 3),
                    _g(r["k3_kl"], 3), _pct(r["k3_share"]), _g(r["mean_abs_log_ratio"], 3)]
                   for r in report["by_probability"]])
    out.append("")

    out.append("Presets on this dump (the engine run per preset)")
    out += _table(["preset", "mode", "loss", "IS", "RS", "veto", "rej tokens", "rej samples", "ESS"],
                  [[n, p["mode"], p["loss_type"],
                    p["is"] + ("" if p["is_weights_applied"] or p["is"] == "-" else " (diag)"), p["rs"],
                    "-" if p["veto"] is None else f"{p['veto']:g}", _pct(p["rejected_token_fraction"]),
                    _pct(p["rejected_seq_fraction"]), _g(p["ess"], 3)] for n, p in report["presets"].items()],
                  left=(0, 1, 2, 3, 4))
    out.append("")

    rec = report["recommendation"]
    out.append(f"Recommended: {report['recommended_preset']}   ({rec['severity']} mismatch"
               + (f", {rec['length_regime']} samples" if rec["length_regime"] else "") + ")")
    out.append(f"  {rec['flags']}")
    out += [f"  - {r}" for r in report["reasons"]]
    out += [f"  warning: {w}" for w in rec["warnings"]]
    out += [f"  note: {n}" for n in rec["notes"]]
    return "\n".join(out) + "\n"
