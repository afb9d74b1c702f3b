"""slime's custom loss with slime-rc's policy loss in every mode.

Launch line (slime)::

    --loss-type custom_loss --custom-loss-function-path slime_rc.slime.policy_loss_function

(``slime_rc.slime.policy_loss_function`` is this module's :func:`policy_loss_function`, re-exported by the package.)

slime's ``loss_function`` calls ``policy_loss_function(args, batch, logits, sum_of_sample_mean)`` once per
micro-batch on the last pipeline stage and rescales the result (``num_microbatches / step_global_batch_size * dp x
cp`` per sample, ``cp`` per token).  So this function returns what slime's own ``policy_loss_function`` returns:
the **sum over this micro-batch's samples** of each sample's mean (this CP rank's share; slime's denominators
``rollout_mask_sums``), or the plain token sum with ``--calculate-per-token-loss``, and a log dict of 0-d tensors
in the same space (slime sums them over micro-batches and DP x CP and divides by the step's samples or tokens).

What it computes, per micro-batch:

* log pi_theta and the entropy of this rank's response tokens from ``[1, T, V / tp]`` CP-local logits
  (:func:`~slime_rc.megatron.logprobs.vocab_parallel_log_probs`, divided by ``args.rollout_temperature``), at the
  rows of megatron's zigzag layout (:mod:`slime_rc.megatron.cp_layout`);
* the correction (:func:`~slime_rc.correction.engine.compute_rollout_correction`, sequence statistics combined over
  the CP group, per micro-batch) and slime-rc's policy loss (:func:`~slime_rc.losses.compute_policy_loss`) in the
  configured mode: standard, decoupled, bypass PPO, bypass REINFORCE (+ IS), with every IS / RS / veto /
  batch-normalization option.  Settings: a config resolved at launch (``args.rollout_correction_config``), else
  :func:`slime_rc.config.arguments.config_from_args` on slime's ``args`` with slime's precedence (YAML beats flags);
* slime's terms around it, as slime's ``policy_loss_function`` has them: ``- entropy_coef * entropy`` and
  ``+ kl_loss_coef * KL(pi_theta, pi_ref)`` (``use_kl_loss``; ``kl_loss_type`` k1 / k2 / k3 / low_var_kl,
  ``use_unbiased_kl``).  Rejected tokens are left out of every numerator (as slime does with a TIS function's
  modified masks).

Log keys: slime's (``loss``, ``pg_loss``, ``entropy_loss``, ``pg_clipfrac``, ``ppo_kl``,
``train_rollout_logprob_abs_diff``, ``kl_loss``, ``ois``) and the engine's ``rollout_corr/<name>``
(:data:`slime_rc.correction.metrics.METRICS`), each the micro-batch's value weighted so that slime's step reduction
gives the sample- (or token-) weighted mean over micro-batches.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from itertools import accumulate
from typing import Any, Dict, Optional, Tuple

import torch

from slime_rc.config.arguments import SLIME_OWNED_FLAGS, config_from_args
from slime_rc.config.knobs import dest_of
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.engine import compute_rollout_correction
from slime_rc.correction.packed import segment_sum, upload
from slime_rc.megatron.reducers import megatron_context_parallel
from slime_rc.losses import LossNormalizer, compute_policy_loss, loss_normalizer
from slime_rc.megatron.cp_layout import ResponseLayout
from slime_rc.megatron.logprobs import vocab_parallel_log_probs

PATH = "slime_rc.slime.policy_loss_function"
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")  # slime's compute_approx_kl
REQUIRED = ("unconcat_tokens", "total_lengths", "response_lengths", "loss_masks", "advantages")
# slime's args this loss does not implement: (attribute, value that is fine, why / the fix)
REFUSED = (
    ("allgather_cp", False, "the custom loss reads megatron's zigzag CP layout; drop --allgather-cp"),
    ("use_opsm", False, "OPSM is slime's own policy loss; use --loss-type policy_loss for it"),
    ("custom_pg_loss_reducer_function_path", None,
     "the custom loss aggregates with slime's denominators itself; drop --custom-pg-loss-reducer-function-path"),
)


# ---- settings ----------------------------------------------------------------------------------------------------
def resolve_config(args: Any) -> RolloutCorrectionConfig:
    """The config for slime's ``args``: ``args.rollout_correction_config`` when slime-rc resolved one at launch,
    else :func:`config_from_args` with slime's precedence, stored there (slime calls the loss once per
    micro-batch).  Without our parser hook, slime's own flags at slime's defaults count as not given."""
    config = getattr(args, "rollout_correction_config", None)
    if config is not None:
        if not isinstance(config, RolloutCorrectionConfig):
            raise ValueError(f"args.rollout_correction_config is a {type(config).__name__}; expected a "
                             f"RolloutCorrectionConfig (slime_rc.config_from_args sets it) or unset")
        return config
    view = argparse.Namespace(**vars(args))
    if getattr(view, "slime_rc_shared_flags", None) is None:  # what add_rollout_correction_arguments records
        view.slime_rc_shared_flags = {dest_of(f): (dest_of(f), kw.get("default"))
                                      for f, kw in SLIME_OWNED_FLAGS.items()}
    config = config_from_args(view, slime=True)
    args.rollout_correction_config = config
    return config


def _check_args(args: Any, config: RolloutCorrectionConfig) -> Tuple[bool, float]:
    """Refuse what this loss does not implement, naming the arg and the fix; ``(per_token, temperature)``."""
    for name, fine, fix in REFUSED:
        if getattr(args, name, fine) not in (fine, None, False):
            raise ValueError(f"{PATH}: args.{name}={getattr(args, name)!r} is not supported: {fix}")
    estimator = getattr(args, "advantage_estimator", None)
    if estimator in ("gspo", "cispo"):
        raise ValueError(f"{PATH}: advantage_estimator={estimator!r} has its own policy loss in slime, not "
                         f"slime-rc's PPO/REINFORCE; use --loss-type policy_loss, or grpo / ppo / reinforce_plus_plus")
    if float(getattr(args, "rollout_top_p", 1.0) or 1.0) != 1.0:
        raise ValueError(f"{PATH}: rollout_top_p={args.rollout_top_p} (top-p replay of the log-probs) is not "
                         f"supported; use --loss-type policy_loss or --rollout-top-p 1.0")
    tis_path = getattr(args, "custom_tis_function_path", None)
    if tis_path and not str(tis_path).startswith("custom_tis."):
        raise ValueError(f"{PATH}: --custom-tis-function-path {tis_path} is not called by the custom loss (slime-rc's "
                         f"engine computes the correction from the same settings); drop it, or keep "
                         f"--loss-type policy_loss to run it")
    if getattr(args, "use_kl_loss", False) and getattr(args, "kl_loss_type", None) not in KL_TYPES:
        raise ValueError(f"{PATH}: kl_loss_type={getattr(args, 'kl_loss_type', None)!r} is not one of slime's KL "
                         f"types {KL_TYPES}; set --kl-loss-type")
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    if config.loss_agg != ("token_mean" if per_token else "sample_mean"):
        raise ValueError(f"{PATH}: loss_agg={config.loss_agg!r} but slime's calculate_per_token_loss={per_token} "
                         f"decides how slime scales the loss; set --calculate-per-token-loss (token_mean) or drop "
                         f"it (sample_mean), and drop loss_agg")
    temperature = getattr(args, "rollout_temperature", 1.0)
    temperature = 1.0 if temperature is None else float(temperature)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{PATH}: rollout_temperature={temperature} must be a finite number > 0 (the rollout "
                         f"engine's sampling temperature)")
    return per_token, temperature


# ---- slime's batch on this rank ----------------------------------------------------------------------------------
class _Layout:
    """This rank's response tokens of each sample: logit rows, target tokens, original masks, all gathered with index
    tensors built from slime's per-sample Python ints (``total_lengths``, ``response_lengths``) -- no host read, a
    fixed number of kernels whatever the number of samples."""

    def __init__(self, batch: Dict[str, Any], n_rows: int, cp_size: int, cp_rank: int, device: torch.device):
        missing = [k for k in REQUIRED if batch.get(k) is None]
        if missing:
            raise ValueError(f"{PATH}: slime's batch lacks {', '.join(missing)} (it needs {', '.join(REQUIRED)}; "
                             f"is --loss-type custom_loss running on slime's actor?)")
        tokens, totals = batch["unconcat_tokens"], [int(x) for x in batch["total_lengths"]]
        responses, masks = [int(x) for x in batch["response_lengths"]], list(batch["loss_masks"])
        sizes = {"unconcat_tokens": len(tokens), "total_lengths": len(totals), "response_lengths": len(responses),
                 "loss_masks": len(masks)}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"{PATH}: one entry per sample in slime's batch: " +
                             ", ".join(f"{k} {v}" for k, v in sizes.items()))
        for i, (tok, total, resp, mask) in enumerate(zip(tokens, totals, responses, masks)):
            if not 0 <= resp < total or tok.numel() < total or mask.numel() != resp:
                raise ValueError(f"{PATH}: sample {i}: total_lengths {total}, response_lengths {resp}, "
                                 f"{tok.numel()} unconcat_tokens and a loss mask of {mask.numel()}: a response "
                                 f"needs a prompt of >= 1 token, the tokens and a full-length mask")
        self.layout = layout = ResponseLayout(totals, responses, cp_size, cp_rank)
        if sum(layout.local_lengths) > n_rows:
            raise ValueError(f"{PATH}: the logits hold {n_rows} positions but this rank's samples need "
                             f"{sum(layout.local_lengths)} (CP {cp_size}, rank {cp_rank}); pass the logits of the same "
                             f"micro-batch")
        self.device = device
        self.n_samples, self.totals, self.responses, self.counts = len(totals), totals, responses, layout.counts
        # where each sample's response starts among the concatenated tokens (log-prob j scores token
        # total - resp + j) and among the concatenated full-length masks
        token_start = [start + total - resp for start, total, resp in
                       zip(accumulate([t.numel() for t in tokens], initial=0), totals, responses)]
        mask_start = list(accumulate(responses, initial=0))
        # [N, 4]: logit row, token index, full-mask index, sample
        index = layout.index(device, token_start, mask_start)
        # the per-sample tensors, concatenated once and gathered once
        self.rows, self.sample_of_token = index[:, 0], index[:, 3]
        self.cu_seqlens = layout.cu_seqlens(device)
        if self.n_samples:
            flat_tokens = torch.cat([t.reshape(-1) for t in tokens]).to(device, non_blocking=True)
            self.targets = flat_tokens.index_select(0, index[:, 1]).long()
            full = torch.cat([m.reshape(-1) for m in masks]).to(device, non_blocking=True)
            self.mask = full.index_select(0, index[:, 2]) != 0
            # each sample's full mask sum (slime's default denominator), float64 on the device
            bounds = upload(list(accumulate(responses, initial=0)), torch.int64, device)
            self.full_mask_sums = segment_sum(full, bounds)
        else:
            self.targets = torch.zeros(0, dtype=torch.int64, device=device)
            self.mask = torch.zeros(0, dtype=torch.bool, device=device)
            self.full_mask_sums = torch.zeros(0, dtype=torch.float64, device=device)

    def tokens(self, batch: Dict[str, Any], key: str, *, required: bool = True) -> Optional[torch.Tensor]:
        """``batch[key]`` (per sample, this rank's response tokens) packed to ``[N]`` float32, lengths checked."""
        value = batch.get(key)
        if value is None or (isinstance(value, (list, tuple)) and len(value) == 0 and self.n_samples):
            if required:
                raise ValueError(f"{PATH}: slime's batch has no {key!r}, which this mode needs")
            return None
        if len(value) != self.n_samples:
            raise ValueError(f"{PATH}: batch[{key!r}] has {len(value)} entries for {self.n_samples} samples")
        for i, (v, n) in enumerate(zip(value, self.counts)):
            if v.numel() != n:
                raise ValueError(f"{PATH}: batch[{key!r}][{i}] holds {v.numel()} values; this CP rank holds {n} of "
                                 f"the sample's {self.responses[i]} response tokens (megatron's zigzag layout: "
                                 f"slime slices per-token keys with slice_log_prob_with_cp)")
        if not self.n_samples:
            return torch.zeros(0, device=self.device)
        return torch.cat([v.reshape(-1) for v in value]).float().to(self.device, non_blocking=True)

    def describe(self, flat_index: int) -> str:
        """Sample and response token of packed index ``flat_index`` (Python ints only)."""
        return self.layout.describe(flat_index)


def _check_finite(checks: DeferredChecks, layout: _Layout, keep: torch.Tensor, name: str,
                  values: torch.Tensor) -> None:
    """A deferred check (no host read here): ``values`` finite at every kept loss token."""
    bad = keep & ~torch.isfinite(values)

    def describe() -> str:  # the slow path: raising anyway
        first = int(torch.nonzero(bad)[0, 0])
        return (f"{PATH}: {name} is {float(values[first])} at a loss token ({layout.describe(first)}); fix the data "
                f"(or zero that token's loss mask): it would put NaN into the gradient")
    checks.add(bad.sum(), f"{PATH}: {name} is not finite at a loss token; fix the data (or zero that token's loss "
                          f"mask): it would put NaN into the gradient", describe)


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str,
              importance_ratio: Optional[torch.Tensor] = None) -> torch.Tensor:
    """slime's ``compute_approx_kl`` (k1, k2, k3 / low_var_kl = exp(-d) - 1 + d, low_var_kl clamped to [-10, 10],
    times the IS ratio pi_theta / pi_old with ``use_unbiased_kl``)."""
    d = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        kl = d
    elif kl_type == "k2":
        kl = d ** 2 / 2.0
    elif kl_type in ("k3", "low_var_kl"):
        kl = (-d).exp() - 1 + d
    else:
        raise ValueError(f"kl_loss_type={kl_type!r} is not one of {KL_TYPES}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(min=-10, max=10) if kl_type == "low_var_kl" else kl


def _denominators(batch: Dict[str, Any], layout: _Layout) -> torch.Tensor:
    """slime's per-sample denominators: ``batch["rollout_mask_sums"]`` (each rollout's mask total), else each
    sample's full mask sum; float64 ``[B]`` on the layout's device."""
    given = batch.get("rollout_mask_sums")
    if given is None:
        return layout.full_mask_sums
    if isinstance(given, torch.Tensor):
        d = given.reshape(-1).to(device=layout.device, dtype=torch.float64, non_blocking=True)
    elif len(given) and all(isinstance(x, torch.Tensor) for x in given):
        d = torch.stack([x.reshape(()) for x in given]).to(device=layout.device, dtype=torch.float64,
                                                            non_blocking=True)
    else:
        d = upload([float(x) for x in given], torch.float64, layout.device)
    if d.numel() != layout.n_samples:
        raise ValueError(f"{PATH}: batch['rollout_mask_sums'] has {d.numel()} entries for {layout.n_samples} samples")
    return d


def _coefficients(per_sample: Optional[torch.Tensor], layout: _Layout, n: int, device) -> torch.Tensor:
    """``c_t`` with ``sum_t c_t x_t`` = slime's ``sum_of_sample_mean`` (``1 / max(D_i, 1)``), or its token sum."""
    if per_sample is None:
        return torch.ones(n, device=device)
    inv = torch.where(per_sample > 0, 1.0 / per_sample.clamp(min=1.0), 0.0).float().to(device)
    return inv.index_select(0, layout.sample_of_token)


# ---- the loss ----------------------------------------------------------------------------------------------------
def policy_loss_function(args: Any, batch: Dict[str, Any], logits: torch.Tensor,
                         sum_of_sample_mean=None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """slime's custom-loss contract: ``(loss, log)`` for one micro-batch on this rank (see the module docstring).

    ``sum_of_sample_mean`` (slime's reducer over the original masks) is accepted for the contract and not used:
    the same reduction is done here with the correction's keep mask and denominators.

    No host read on the way (a GPU stream never waits for this function): index tensors come from slime's Python
    ints, every tensor is made on the logits' device, the log values stay tensors, and the checks of values
    (non-finite log-probs, advantages, reference log-probs on loss tokens) are deferred: with
    ``on_nonfinite='error'`` one host read at the end, after everything is queued; with ``'reject'`` none (the
    engine rejects non-finite log-probs; the remaining checks become device-side asserts)."""
    config = resolve_config(args)
    per_token, temperature = _check_args(args, config)
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[0] == 1):
        raise ValueError(f"{PATH}: logits must be [1, T, V/tp] (slime's packed micro-batch), got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    cp_size, cp_rank, reducer = megatron_context_parallel()
    dev = logits.device
    layout = _Layout(batch, logits.shape[1], cp_size, cp_rank, dev)
    checks = DeferredChecks(read=config.on_nonfinite == "error")
    bypass = config.mode == "bypass"
    use_kl = bool(getattr(args, "use_kl_loss", False))
    entropy_coef = float(getattr(args, "entropy_coef", 0.0) or 0.0)
    kl_coef = float(getattr(args, "kl_loss_coef", 0.0) or 0.0)

    # every row of the logits, as slime does: selecting the response rows first would copy them ([N, V]), and
    # indexing (logits[0]) or slicing would make backward fill a zero [T, V] gradient (a view's backward is free);
    # the other rows' gradient is 0 either way
    targets = torch.zeros(logits.shape[1], dtype=torch.int64, device=dev).index_copy_(0, layout.rows,
                                                                                        layout.targets)
    chunk = int(getattr(args, "log_probs_chunk_size", -1) or -1)
    log_probs, entropy = vocab_parallel_log_probs(logits.reshape(-1, logits.shape[-1]), targets, temperature,
                                                  with_entropy=True, entropy_grad=entropy_coef != 0,
                                                  chunk_rows=chunk)
    log_probs, entropy = log_probs.index_select(0, layout.rows), entropy.index_select(0, layout.rows)
    advantages = layout.tokens(batch, "advantages")
    rollout = layout.tokens(batch, "rollout_log_probs",
                            required=bypass or config.corrects or config.get_mismatch_metrics)
    recomputed = None if bypass else layout.tokens(batch, "log_probs", required=False)
    # slime: without a recompute pass pi_old is the current policy (detached)
    old = rollout if bypass else (log_probs.detach() if recomputed is None else recomputed)
    ref = layout.tokens(batch, "ref_log_probs") if use_kl else None
    mask = layout.mask
    correction = None
    if config.corrects or config.get_mismatch_metrics:
        train = log_probs.detach() if bypass else old
        correction = compute_rollout_correction(train, rollout, mask, layout.cu_seqlens, config, reducer=reducer,
                                                checks=checks)
    keep = mask if correction is None else (correction.keep_mask.bool() & mask)
    # what reaches the loss must be finite (the engine has already dealt with non-finite log-prob ratios)
    _check_finite(checks, layout, keep, "batch['advantages']", advantages)
    if ref is not None:
        _check_finite(checks, layout, keep, "batch['ref_log_probs']", ref)
    if not bypass:
        _check_finite(checks, layout, keep, "batch['log_probs'] (pi_old)", old)

    denominators = None if per_token else _denominators(batch, layout)
    counted = denominators
    if correction is not None and not per_token and not config.rejected_in_denominator:
        rejected = loss_normalizer(mask & ~keep, layout.cu_seqlens, reducer).per_sequence.double()
        counted = denominators - rejected
    one = torch.ones((), dtype=torch.float64, device=dev)
    normalizer = LossNormalizer(tokens=one, sequences=one,
                                per_sequence=(torch.zeros(layout.n_samples, dtype=torch.float64, device=dev)
                                              if counted is None else counted).to(dev))
    pg_config = replace(config, loss_agg="token_mean" if per_token else "sample_mean")
    pg_loss, pg_metrics = compute_policy_loss(log_probs, old, rollout, advantages, mask, layout.cu_seqlens,
                                              pg_config, reducer=reducer, correction=correction,
                                              normalizer=normalizer, checks=checks)

    n = log_probs.numel()
    coef = _coefficients(counted, layout, n, dev)  # the policy loss's (kept tokens)
    coef_orig = _coefficients(denominators, layout, n, dev)  # slime's original masks (mismatch metrics)
    zero = torch.zeros((), device=dev)

    def kept_sum(x: torch.Tensor) -> torch.Tensor:
        return (torch.where(keep, x, zero) * coef).sum()

    entropy_loss = kept_sum(entropy)
    loss = pg_loss - entropy_coef * entropy_loss
    log: Dict[str, torch.Tensor] = {}
    kl_loss = None
    if use_kl:
        lp_k = torch.where(keep, log_probs, zero)
        ratio = None
        if getattr(args, "use_unbiased_kl", False):
            ratio = torch.exp(lp_k - torch.where(keep, old, zero).detach())
        kl_loss = kept_sum(approx_kl(lp_k, torch.where(keep, ref, zero), args.kl_loss_type, ratio))
        loss = loss + kl_coef * kl_loss
    if n == 0:  # slime: make sure the gradient reaches every rank's logits
        loss = loss + 0 * logits.sum()

    log.update(loss=loss.detach(), pg_loss=pg_metrics["pg_loss"], entropy_loss=entropy_loss.detach(),
               pg_clipfrac=pg_metrics["pg_clipfrac"], ppo_kl=pg_metrics["ppo_kl"])
    if rollout is not None:
        compared = log_probs.detach() if bypass else old
        log["train_rollout_logprob_abs_diff"] = kept_sum((compared - torch.where(keep, rollout, zero)).abs())
    if kl_loss is not None:
        log["kl_loss"] = kl_loss.detach()
    if correction is not None:
        d = torch.where(mask, log_probs.detach() - torch.where(mask, old, zero), zero)
        log["ois"] = (torch.where(mask, d.exp(), zero) * coef_orig).sum()
        # the engine's micro-batch values (global over the CP group) in slime's step space: slime sums a key over
        # micro-batches and DP x CP ranks and divides by the step's samples (tokens with per-token loss)
        if per_token:  # the samples' full mask sums, each at least 1 (a device value: no read)
            weight = (layout.full_mask_sums.clamp(min=1.0).sum() / cp_size).float()
        else:
            weight = layout.n_samples / cp_size
        engine = correction.prefixed()
        if engine:  # one stack, one scale: a few kernels for the ~40 metrics
            log.update(zip(engine, (torch.stack([v.detach().reshape(()) for v in engine.values()]).float().to(dev)
                                    * weight).unbind()))
    checks.raise_if_any()  # the one host read of the call (none with on_nonfinite='reject')
    return loss, {k: v.detach().float().reshape(()) for k, v in log.items()}
