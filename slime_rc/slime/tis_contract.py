"""slime's custom-TIS contract, as the TIS functions (:mod:`slime_rc.slime.tis_hooks`, re-exported by ``custom_tis``) take
and return it: the ONE representation of slime's batch (per-sample lists <-> zigzag CP positions <-> packed tokens).

slime calls ``fn(args, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=, total_lengths=,
response_lengths=)`` once per micro-batch on every rank (``slime/backends/megatron_utils/loss.py``):

* ``pg_loss`` ``[N]`` and the log-prob lists are this CP rank's tokens (megatron's zigzag layout,
  :mod:`slime_rc.megatron.cp_layout`); ``loss_masks`` are FULL response length (``torch.int``);
* it expects ``(pg_loss_out [N], masks at full response length, {name: [N] per-token metric})`` and cuts the
  masks into its rank's zigzag chunks itself.  Loss denominators stay the original masks' sums.

Each rank knows the decisions of its own tokens and the sequence-level decisions of every sequence (those are
combined over the CP group).  So the returned full-length mask holds this rank's decisions at its own positions
and, at the positions other ranks hold, the original mask times the sequence-level decision; slime reads only the
rank's own positions (``cp_utils.get_sum_of_sample_mean``).  Nothing per token crosses ranks.

Everything here is plumbing (lists <-> packed tensors, zigzag positions, full-length masks, dtypes); the math is
in :mod:`slime_rc.slime.mis` (slime's semantics) and :func:`slime_rc.compute_rollout_correction` (slime-rc's).

No host read on the way (slime calls once per micro-batch; a GPU stream never waits here): the per-sample lists
are concatenated once and gathered with index tensors built from slime's Python ints, and the value checks (a
loss mask of 0/1, finite log-probs on loss tokens) go into one :class:`~slime_rc.correction.checks.DeferredChecks`
per call, read once at the end -- none with the engine's ``on_nonfinite='reject'``.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction
from slime_rc.correction.packed import token_sequence_ids, upload
from slime_rc.correction.reducer import LocalReducer
from slime_rc.megatron.reducers import megatron_context_parallel
from slime_rc.slime.settings import get
from slime_rc.megatron.cp_layout import ResponseLayout

TensorList = List[torch.Tensor]


# ---- where the settings come from --------------------------------------------------------------------------------
def launch_config(args: Any) -> Optional[RolloutCorrectionConfig]:
    """The config resolved at launch by slime-rc (``slime_rc.config_from_args``: ``slime-rc train``, a Megatron
    launch with our flags), if any.  It selects slime-rc's own semantics (the engine)."""
    return get(args, "rollout_correction_config")


# ---- the CP layout -----------------------------------------------------------------------------------------------
class Batch:
    """One call's samples, packed: this rank's tokens of each sample and where they sit in the full responses.

    ``train``, ``rollout``: ``[N]`` float32; ``mask``: ``[N]`` float32 0/1 (the original loss mask at this rank's
    tokens); ``cu_seqlens``: ``[B+1]``; ``lengths``: this rank's token count per sample; ``sample_of_token``:
    ``[N]`` integer (a property, built on first use); ``full_index`` / ``positions``: ``[N]`` int64 position of each
    token in the concatenated full masks / in its sample's response (None when this rank holds every response whole:
    no CP); ``full_masks``: the caller's full-length masks.  ``checks`` receives the check that the masks hold only
    0 and 1 (deferred: no host read here; without ``checks`` it is read at once).
    """

    def __init__(self, train_log_probs: TensorList, rollout_log_probs: TensorList, loss_masks: TensorList,
                 total_lengths: Optional[Sequence[int]] = None, response_lengths: Optional[Sequence[int]] = None,
                 cp: Tuple[int, int] = (1, 0), checks: Optional[DeferredChecks] = None):
        for name, v in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs),
                        ("loss_masks", loss_masks)):
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"{name} must be a list with one 1-D tensor per sample, got {type(v).__name__}")
        counts = {"train_log_probs": len(train_log_probs), "rollout_log_probs": len(rollout_log_probs),
                  "loss_masks": len(loss_masks)}
        if total_lengths is not None:
            counts.update(total_lengths=len(total_lengths), response_lengths=len(response_lengths))
        if len(set(counts.values())) > 1:
            raise ValueError("one entry per sample in every list: got " + ", ".join(f"{k} {v}" for k, v in
                                                                                     counts.items()))
        cp_size, cp_rank = cp
        lengths, full_lengths = [], []
        for i, (t, r, m) in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks)):
            for name, v in (("train_log_probs", t), ("rollout_log_probs", r), ("loss_masks", m)):
                if not isinstance(v, torch.Tensor) or v.dim() != 1:
                    raise ValueError(f"sample {i}: {name} must be a 1-D tensor, got "
                                     f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
            if t.shape != r.shape:
                raise ValueError(f"sample {i}: train_log_probs holds {t.numel()} tokens, rollout_log_probs "
                                 f"{r.numel()}; both must be this rank's tokens of the response")
            if total_lengths is None:
                if m.numel() != t.numel():
                    raise ValueError(f"sample {i}: loss_masks holds {m.numel()} tokens, the log-probs "
                                     f"{t.numel()}; pass one mask per response, as long as its log-probs")
            else:
                total, resp = int(total_lengths[i]), int(response_lengths[i])
                if m.numel() != resp:
                    raise ValueError(f"sample {i}: loss_masks must be the full response mask of "
                                     f"response_lengths[{i}]={resp} tokens, got {m.numel()} (slime passes full-length "
                                     f"masks and CP-local log-probs)")
                if not 0 <= resp <= total:
                    raise ValueError(f"response_length={resp} must lie in [0, total_length={total}]")
            lengths.append(t.numel())
            full_lengths.append(m.numel())
        layout = None
        if total_lengths is not None:
            # without CP a rank holds the whole response (megatron's layout, cp_layout.ResponseLayout)
            layout = ResponseLayout(total_lengths, response_lengths, cp_size, cp_rank) if cp_size > 1 else None
            for i, n in enumerate(lengths):
                held = int(response_lengths[i]) if layout is None else layout.counts[i]
                if held != n:
                    raise ValueError(
                        f"sample {i}: train_log_probs holds {n} tokens but context-parallel rank {cp_rank} of "
                        f"{cp_size} holds {held} of its {int(response_lengths[i])} response tokens "
                        f"(total_lengths[{i}]={int(total_lengths[i])}, megatron's zigzag layout); pass this rank's "
                        f"log-probs")
        self.n_samples, self.lengths, self.full_lengths = len(lengths), lengths, full_lengths
        # (sample, response position, count) of this rank's runs of consecutive response tokens
        self.runs = ([(i, 0, n) for i, n in enumerate(lengths)] if layout is None
                     else [(i, j, n) for i, _, j, n in layout.runs])
        self.full_masks = list(loss_masks)
        device = train_log_probs[0].device if lengths else torch.device("cpu")
        self.device = device
        # without CP every rank holds each whole response: the packed tokens ARE the full masks' positions, so the
        # gathers and scatters between the two are the identity (skipped)
        self.whole = total_lengths is None or cp_size == 1
        self.cu_seqlens = upload(list(accumulate(lengths, initial=0)), torch.int64, device)
        if self.whole:
            self.full_index = self.positions = None
            self._sample_of_token = None  # built on first use: slime's semantics (slime_rc.slime.mis) never need it
        else:
            # [N, 3]: index in the concatenated full masks, response position, sample
            index = layout.index(device, list(accumulate(full_lengths, initial=0)), [0] * len(lengths), rows=False)
            self.full_index, self.positions, self._sample_of_token = index[:, 0], index[:, 1], index[:, 2]
        if lengths:
            self.train = torch.cat([t.reshape(-1) for t in train_log_probs]).to(device, non_blocking=True).float()
            self.rollout = torch.cat([t.reshape(-1) for t in rollout_log_probs]).to(device, non_blocking=True).float()
            self.full_mask = torch.cat([m.reshape(-1) for m in loss_masks]).to(device, non_blocking=True)
            mask = self.full_mask if self.whole else self.full_mask.index_select(0, self.full_index)
        else:
            self.train = torch.zeros(0, device=device)
            self.rollout = torch.zeros(0, device=device)
            self.full_mask = mask = torch.zeros(0, device=device)
        # the comparison written straight into float32: one op and one [N] buffer (a bool result and its copy: two)
        self.mask = torch.ne(mask, 0, out=torch.empty(mask.shape, dtype=torch.float32, device=mask.device))
        own = checks is None
        checks = DeferredChecks() if own else checks
        if mask.dtype != torch.bool:  # (a bool mask holds nothing else)
            # an integer other than 0 and 1 has a bit set above the lowest (a negative one, the sign bit); a float
            # other than 0 and 1 (NaN included) differs from its own "!= 0" as 0/1
            bad = torch.bitwise_and(mask, -2) if not mask.is_floating_point() else self.mask != mask
            checks.add(torch.count_nonzero(bad), "loss_masks must hold only 0 and 1")
        if own:
            checks.raise_if_any()

    @property
    def sample_of_token(self) -> torch.Tensor:
        """``[N]`` the sample of each packed token: int32 built on first use without CP, int64 from the runs under CP
        (``index_select`` takes either)."""
        if self._sample_of_token is None:
            self._sample_of_token = token_sequence_ids(self.cu_seqlens, self.train.numel())
        return self._sample_of_token

    def describe(self, j: int) -> str:
        """Sample and response position of packed token ``j`` (the slow path of an error: reads freely)."""
        sample, position, rest = -1, -1, j
        for i, start, n in self.runs:
            if rest < n:
                sample, position = i, start + rest
                break
            rest -= n
        which = "train_log_probs" if not math.isfinite(float(self.train[j])) else "rollout_log_probs"
        value = float((self.train if which == "train_log_probs" else self.rollout)[j])
        return f"{which} is {value} at sample {sample}, response position {position}"

    def split(self, packed: torch.Tensor) -> TensorList:
        return list(packed.split(self.lengths)) if self.lengths else []

    def full_length_masks(self, keep: torch.Tensor, seq_keep: torch.Tensor) -> TensorList:
        """Full-length masks in the callers' dtype: ``keep`` at this rank's positions, the original mask times the
        sequence decision ``seq_keep [B]`` elsewhere.  One gather, one scatter, one split (views)."""
        if not self.n_samples:
            return []
        dtype = self.full_mask.dtype
        if self.whole:  # every position is this rank's: the masks are keep
            full = keep.to(dtype)
            return [f if f.dtype == m.dtype else f.to(m.dtype)
                    for f, m in zip(full.split(self.full_lengths), self.full_masks)]
        sample_of_full = token_sequence_ids(
            upload(list(accumulate(self.full_lengths, initial=0)), torch.int64, self.device), self.full_mask.numel())
        full = ((self.full_mask != 0) & seq_keep.to(self.device).index_select(0, sample_of_full)).to(dtype)
        full = full.index_copy(0, self.full_index, keep.to(dtype))
        return [f if f.dtype == m.dtype else f.to(m.dtype)
                for f, m in zip(full.split(self.full_lengths), self.full_masks)]


def check_pg_loss(pg_loss: torch.Tensor, batch: Batch) -> None:
    if not isinstance(pg_loss, torch.Tensor) or pg_loss.numel() != sum(batch.lengths):
        got = pg_loss.numel() if isinstance(pg_loss, torch.Tensor) else type(pg_loss).__name__
        raise ValueError(f"pg_loss holds {got} tokens but this CP rank's log-probs hold {sum(batch.lengths)}; "
                         f"pass the per-token loss of the same tokens")


def apply_weights(pg_loss: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``pg_loss * weights`` in ``pg_loss``'s dtype and shape (weights carry no gradient)."""
    if weights is None:
        return pg_loss
    return pg_loss * weights.detach().to(pg_loss.dtype).reshape(pg_loss.shape)


def new_checks(compute: Callable) -> DeferredChecks:
    """One call's deferred checks: read once at the end (slime's semantics raise on bad input), or never with the
    engine's ``on_nonfinite='reject'`` (``compute.read_checks``)."""
    return DeferredChecks(read=getattr(compute, "read_checks", True))


def run_with_cp(compute: Callable[[Batch, LocalReducer, DeferredChecks],
                                  Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]],
                *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                prefix: str = "", cp: Optional[Tuple[int, int, LocalReducer]] = None):
    """slime's CP contract around ``compute(batch, reducer, checks) -> (weights [N] | None, keep [N], seq_keep [B],
    metrics {name: [N]})``: returns ``(pg_loss * weights, full-length masks, {prefix + name: [N]})``.  ``compute``
    adds its value checks to ``checks``, read once here at the end."""
    cp_size, cp_rank, reducer = megatron_context_parallel() if cp is None else cp
    checks = new_checks(compute)
    batch = Batch(train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, (cp_size, cp_rank),
                  checks=checks)
    check_pg_loss(pg_loss, batch)
    weights, keep, seq_keep, metrics = compute(batch, reducer, checks)
    masks = batch.full_length_masks(keep, seq_keep)
    out = apply_weights(pg_loss, weights), masks, {prefix + k: v.float() for k, v in metrics.items()}
    checks.raise_if_any()  # the one host read of the call (none with on_nonfinite='reject')
    return out


def run_lists(compute, *, train_log_probs, rollout_log_probs, loss_masks, weights_when_off: bool = True):
    """slime's non-CP form: ``(weights list | None, masks list, {name: list})``, one process."""
    checks = new_checks(compute)
    batch = Batch(train_log_probs, rollout_log_probs, loss_masks, checks=checks)
    weights, keep, _, metrics = compute(batch, LocalReducer(), checks)
    dtype = batch.full_masks[0].dtype if batch.full_masks else keep.dtype
    masks = [k if k.dtype == m.dtype else k.to(m.dtype)
             for k, m in zip(batch.split(keep.to(dtype)), batch.full_masks)]
    out = (None if weights is None else batch.split(weights), masks,
           {k: batch.split(v.float()) for k, v in metrics.items()})
    checks.raise_if_any()  # the one host read of the call (none with on_nonfinite='reject')
    return out


# ---- slime-rc's own semantics (a config resolved at launch) ------------------------------------------------------
def engine_compute(config: RolloutCorrectionConfig) -> Callable:
    """``compute`` for :func:`run_with_cp` / :func:`run_lists` from slime-rc's engine."""

    def compute(batch: Batch, reducer: LocalReducer, checks: DeferredChecks):
        result = compute_rollout_correction(batch.train, batch.rollout, batch.mask, batch.cu_seqlens, config,
                                            reducer=reducer, checks=checks)
        return (result.is_weights, result.keep_mask, result.sequences["kept"] > 0,
                token_metrics(result, config, batch))
    compute.read_checks = config.on_nonfinite == "error"
    return compute


def token_metrics(result: CorrectionResult, config: RolloutCorrectionConfig, batch: Batch) -> Dict[str, torch.Tensor]:
    """The engine's metrics as slime-style per-token values (``[N]`` float32) for slime's per-sample masked mean:
    token metrics hold the token's value, sequence metrics broadcast the sequence's (global) value."""
    train, rollout, loss_mask = batch.train, batch.rollout, batch.mask
    seq = result.sequences
    bound = config.safety_bound

    def per_seq(values: torch.Tensor) -> torch.Tensor:  # [B] -> [N], float32: one gather
        return values.float().index_select(0, batch.sample_of_token)

    lr_raw = train - rollout
    finite = torch.isfinite(lr_raw)
    lr = torch.where(finite, lr_raw, 0.0)
    lr_c = lr.clamp(-bound, bound)
    ratio = torch.exp(lr_c)
    mask = loss_mask != 0
    valid = mask & finite
    has = seq["valid_tokens"] > 0
    mean_train, mean_rollout = seq["train_log_prob_mean"], seq["rollout_log_prob_mean"]
    d = mean_rollout - mean_train

    def seq_metric(values: torch.Tensor) -> torch.Tensor:
        return per_seq(torch.where(has, values, 0.0))

    out = {
        "training_log_ppl": seq_metric(-mean_train),
        "training_ppl": seq_metric(torch.exp((-mean_train).clamp(max=bound))),
        "rollout_log_ppl": seq_metric(-mean_rollout),
        "rollout_ppl": seq_metric(torch.exp((-mean_rollout).clamp(max=bound))),
        "log_ppl_diff": seq_metric(d),
        "log_ppl_abs_diff": seq_metric(d.abs()),
        "ppl_ratio": seq_metric(torch.exp(d.clamp(-bound, bound))),
        "chi2_seq": seq_metric(torch.exp(2 * seq["log_ratio_sum"].clamp(-bound, bound)) - 1),
        "kl": -lr,
        "k3_kl": ratio - 1 - lr_c,
        "chi2_token": ratio * ratio - 1,
        "raw_ratio": torch.where(finite, ratio, 0.0),
        "rejected_token_fraction": (mask & (result.keep_mask == 0)).float(),
        "rejected_seq_fraction": per_seq(1.0 - seq["kept"]),
    }
    if config.veto_threshold is not None:
        out["catastrophic_token_fraction"] = (valid & (lr < math.log(config.veto_threshold))).float()
    if config.is_enabled:
        out["is_weight"] = result.is_weights.float()
        out["is_seq_weight"] = seq_metric(seq["is_weight"])
        if config.is_level == "token":
            raw, raw_ok = lr, valid
        else:
            s = seq["log_ratio_sum"]
            raw = per_seq(s if config.is_level == "sequence" else s / seq["valid_tokens"].clamp(min=1))
            raw_ok = per_seq(has.double()) > 0
        out["is_ratio_fraction_high"] = (raw_ok & (raw > math.log(config.is_upper_bound))).float()
        out["is_ratio_fraction_low"] = (raw_ok & (raw < math.log(config.is_lower))).float()
    return {k: v.detach() for k, v in out.items()}
