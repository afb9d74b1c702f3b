"""SGLang ingestion (``slime_rc.sglang_output``): meta_info -> tensors, and the sampling-consistency check between the
rollout's sampling_params and the trainer's temperature.  (The HTTP client is tested in test_rollout_engine.py.)"""

import warnings

import pytest
import torch

from slime_rc import RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths
from slime_rc.megatron.logprobs import vocab_parallel_log_probs
from slime_rc.sglang_output import (check_sampling_consistency, response_tokens_from_meta_info,
                             rollout_log_probs_from_meta_info)


def test_one_parser_for_the_client_and_the_package():
    import slime_rc.demo.rollout as rollout
    assert rollout.rollout_log_probs_from_meta_info is rollout_log_probs_from_meta_info
    assert rollout.response_tokens_from_meta_info is response_tokens_from_meta_info


def test_meta_info_batch_into_the_engine():
    """Three SGLang results -> packed rollout log-probs -> the engine's metrics against the trainer's."""
    metas = [{"output_token_logprobs": [[-0.25, 5, "a"], [-1.5, 2, None]]},
             {"output_token_logprobs": [[-3.0, 9, "x"]]},
             {"output_token_logprobs": [[-0.5, 1, None], [-0.75, 4, None], [-2.0, 11, None]]}]
    tokens = [[5, 2], [9], [1, 4, 11]]
    rollout = torch.cat([rollout_log_probs_from_meta_info(m, t) for m, t in zip(metas, tokens)])
    assert rollout.dtype == torch.float32 and rollout.tolist() == [-0.25, -1.5, -3.0, -0.5, -0.75, -2.0]
    train = rollout + torch.tensor([0.1, -0.1, 0.0, 0.2, 0.0, -0.2])
    out = compute_rollout_correction(train, rollout, torch.ones(6), cu_seqlens_from_lengths([2, 1, 3]),
                                     RolloutCorrectionConfig())
    assert float(out.metrics["kl"]) == pytest.approx(0.0, abs=1e-7)  # the shifts cancel: k1 = 0
    assert float(out.metrics["k3_kl"]) > 1e-3  # ... k3 does not


@pytest.mark.parametrize("params,trainer_t,expected", [
    ({"temperature": 0.7}, 0.7, []),
    ({}, 1.0, []),  # SGLang's defaults: temperature 1, no truncation
    ({"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0}, 0.7, []),
    ({"temperature": 0.7}, 1.0, ["rollout temperature=0.7 but the trainer scores logits / 1"]),
    ({}, 0.6, ["rollout temperature=1 but the trainer scores logits / 0.6"]),
    ({"temperature": 0.0}, 1.0, ["greedy decoding"]),
    ({"temperature": 1.0, "top_p": 0.9}, 1.0, ["truncated sampling (top_p=0.9)"]),
    ({"temperature": 0.8, "top_k": 20, "min_p": 0.05}, 0.9,
     ["rollout temperature=0.8 but", "truncated sampling (top_k=20, min_p=0.05)"]),
])
def test_sampling_consistency(params, trainer_t, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        problems = check_sampling_consistency(params, trainer_t)
    assert len(problems) == len(expected), problems
    for text, want in zip(problems, expected):
        assert want in text, (text, want)
    assert [str(w.message) for w in caught] == problems
    assert all(w.category is RuntimeWarning for w in caught)
    assert check_sampling_consistency(params, trainer_t, warn=False) == problems


def test_sampling_consistency_refuses_bad_arguments():
    with pytest.raises(ValueError, match="trainer_temperature=0"):
        check_sampling_consistency({}, 0)
    with pytest.raises(ValueError, match="sampling_params mapping"):
        check_sampling_consistency([("temperature", 1.0)], 1.0)


def test_a_temperature_gap_is_a_mismatch_the_check_explains():
    """The same logits scored at the trainer's temperature 1 vs SGLang's 0.7: a large 'mismatch' with no numerical
    cause at all; at the rollout's temperature it is exactly 0.  The check names the cause before training."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 32, generator=g)
    targets = torch.randint(0, 32, (64,), generator=g)
    rollout = vocab_parallel_log_probs(logits, targets, temperature=0.7)
    cu = cu_seqlens_from_lengths([16] * 4)
    metrics = {t: compute_rollout_correction(vocab_parallel_log_probs(logits, targets, temperature=t), rollout,
                                             torch.ones(64), cu, RolloutCorrectionConfig()).metrics
               for t in (0.7, 1.0)}
    assert float(metrics[0.7]["k3_kl"]) == 0.0
    assert float(metrics[1.0]["k3_kl"]) > 0.05  # far above bf16-level mismatch (~1e-3)
    assert check_sampling_consistency({"temperature": 0.7}, 1.0, warn=False)
    assert not check_sampling_consistency({"temperature": 0.7}, 0.7, warn=False)
