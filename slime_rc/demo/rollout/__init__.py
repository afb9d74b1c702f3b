"""The rollout side of the RL trainer, separate from it as in production: two rollout engines with the same
``generate(prompts, max_new_tokens, stop_token=None) -> [{prompt, response, rollout_log_probs, ...}]`` -- an in-process
pure-torch one with controllable train/rollout mismatch (:mod:`.in_process`) and a client for a real SGLang server
(:mod:`.sglang_client`)."""

from slime_rc.demo.rollout.in_process import DTYPES, RolloutEngine, TorchGPT, forward_class, sampling_mask
from slime_rc.demo.rollout.torch_qwen2 import TorchQwen2
from slime_rc.demo.rollout.sglang_client import SGLangEngine, response_tokens_from_meta_info, rollout_log_probs_from_meta_info

__all__ = ["TorchGPT", "TorchQwen2", "forward_class", "RolloutEngine", "DTYPES", "sampling_mask", "SGLangEngine",
           "rollout_log_probs_from_meta_info", "response_tokens_from_meta_info"]
