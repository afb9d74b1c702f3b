"""Step time on a tiny real megatron-core GPT (1 process; CPU/gloo here, CUDA/NCCL when a GPU is present):
what bypass mode saves over decoupled mode, and the correction's own share of a step.

    python benchmarks/bench_megatron_step.py [--steps 7] [--micro-batches 8] [--hidden 64] [--layers 4]
                                             [--loss megatron|slime]

``--loss slime`` runs the training step's loss through slime's custom loss (``slime_rc.slime.policy_loss_function``
on slime's batch format, as slime's ``--loss-type custom_loss`` calls it) instead of ``make_loss_func``; there the
decoupled correction is per micro-batch (slime has no pre-step hook) and ``prepare`` is 0.

Per step, median over ``--steps`` (after one warm-up step):

* ``decoupled``: a forward-only pass recomputes log pi_old for the global batch, ``prepare_global_batch`` computes
  the correction of the whole batch (token TIS + batch normalization + token RS + veto), then the training step;
* ``standard``: the same recompute + step with no correction (the correction's cost in decoupled mode is the
  difference, and ``prepare`` is timed on its own);
* ``bypass + correction``: the training step alone, REINFORCE with sequence IS + geometric RS in the loss (pi_theta
  / pi_rollout needs no recompute pass);
* ``bypass plain``: bypass PPO without correction (the correction's cost in bypass mode is the difference).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_rc import RolloutCorrectionConfig, parse_rejection_criteria  # noqa: E402

TEMPERATURE = 0.7


def make_batch(n_micro_batches: int, vocab: int, seed: int = 0):
    """Packed micro-batches of 2-4 sequences of 24..96 tokens with loss masks, advantages and rollout log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro_batches):
        lengths = [int(x) for x in torch.randint(24, 97, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g)]
        cu = torch.tensor([0] + lengths).cumsum(0)
        n = int(cu[-1])
        mask = torch.ones(n)
        mask[cu[1:] - 1] = 0.0  # the last position of a sequence has no target
        adv = torch.cat([torch.full((m,), float(torch.randn(1, generator=g))) for m in lengths])
        rollout = -math.log(vocab) + 0.2 * torch.randn(n, generator=g)
        out.append(dict(tokens=torch.randint(0, vocab, (n,), generator=g), cu_seqlens=cu, loss_mask=mask,
                        advantages=adv, rollout_log_probs=rollout))
    return out


def slime_batches(mbs):
    """Each packed micro-batch in slime's batch format (every target a response token; 1 process: no CP cut)."""
    from slime_rc.megatron.loss import with_sample_fields

    out = []
    for mb in mbs:
        s = with_sample_fields(mb)
        b = dict(unconcat_tokens=[], total_lengths=s["sample_lengths"], response_lengths=s["sample_response_lengths"],
                 loss_masks=s["sample_loss_masks"], advantages=[], log_probs=[], rollout_log_probs=[])
        for a, total, resp in zip(mb["cu_seqlens"].tolist(), s["sample_lengths"], s["sample_response_lengths"]):
            b["unconcat_tokens"].append(mb["tokens"][a:a + total])
            start = a + total - resp - 1
            for key, field in (("advantages", "advantages"), ("log_probs", "old_log_probs"),
                               ("rollout_log_probs", "rollout_log_probs")):
                if field in mb:
                    b[key].append(mb[field][start:start + resp].float())
        if not b["log_probs"]:
            del b["log_probs"]
        out.append(b)
    return out


def slime_loss_func(config, mbs, n_samples: int):
    """``loss_fn(logits, lmb)``: slime's custom loss on micro-batch ``lmb``'s slime batch, slime's per-sample scaling."""
    from slime_rc.slime import policy_loss_function

    args = argparse.Namespace(rollout_correction_config=config, rollout_temperature=TEMPERATURE, entropy_coef=0.0,
                              use_kl_loss=False, calculate_per_token_loss=False,
                              use_rollout_logprobs=config.mode == "bypass")
    batches, scale, calls = slime_batches(mbs), len(mbs) / n_samples, {"i": 0}

    def loss_fn(logits, lmb):
        b = batches[lmb.get("micro_batch_index", calls["i"] % len(batches))]
        calls["i"] += 1
        loss, log = policy_loss_function(args, b, logits.reshape(1, -1, logits.shape[-1]), None)
        return loss * scale, log

    return loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--loss", choices=("megatron", "slime"), default="megatron",
                        help="the step's loss: slime_rc.megatron.loss.make_loss_func, or slime's custom loss")
    args = parser.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = os.path.join(tempfile.mkdtemp(prefix="slime_rc_bench_"), "store")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)

    from slime_rc.demo import model as M
    from slime_rc.megatron.logprobs import vocab_parallel_log_probs
    from slime_rc.megatron.loss import make_loss_func, prepare_global_batch

    M.initialize_parallel()
    cfg = M.TinyGPTConfig(hidden_size=args.hidden, num_layers=args.layers, ffn_hidden_size=2 * args.hidden)
    model = M.build_model(cfg, calculate_per_token_loss=False)
    optimizer = M.build_optimizer(model, lr=1e-4)
    batch = make_batch(args.micro_batches, cfg.vocab_size)
    configs = {
        "standard": RolloutCorrectionConfig(),
        "decoupled": RolloutCorrectionConfig(is_level="token", is_batch_normalize=True, veto_threshold=1e-4,
                                             rs=parse_rejection_criteria("token", 2.0)),
        "bypass + correction": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="sequence",
                                                       rs=parse_rejection_criteria("geometric", "0.5_2.0")),
        "bypass plain": RolloutCorrectionConfig(mode="bypass"),
    }
    timings = {name: {"step": [], "recompute": [], "prepare": []} for name in configs}

    def recompute(mbs):
        """Forward-only pass: log pi_old of every target, back in each micro-batch's packed order."""
        def record(logits, lmb):
            logp = vocab_parallel_log_probs(logits, lmb["targets"], TEMPERATURE)
            return logp.sum() * 0.0, {"logp": logp.detach()}
        r = M.train_step(model, None, mbs, record, forward_only=True)
        return [dict(mb, old_log_probs=M.gather_to_global(o["logp"], lmb))
                for mb, o, lmb in zip(mbs, r.outputs, r.local_micro_batches)]

    for it in range(args.steps + 1):
        for name, config in configs.items():
            t0 = time.perf_counter()
            mbs, t_re, t_prep, prepared = batch, 0.0, 0.0, None
            if config.mode != "bypass":
                mbs = recompute(batch)
                t_re = time.perf_counter() - t0
            local = M.shard_for_step(model, mbs)
            if args.loss == "slime":
                loss_fn = slime_loss_func(config, mbs, sum(mb["cu_seqlens"].numel() - 1 for mb in mbs))
            else:
                if config.mode == "decoupled":
                    t1 = time.perf_counter()
                    prepared = prepare_global_batch(local, config)
                    t_prep = time.perf_counter() - t1
                loss_fn = make_loss_func(config, temperature=TEMPERATURE, prepared=prepared,
                                         num_microbatches=len(mbs))
            M.train_step(model, optimizer, mbs, lambda logits, lmb: loss_fn(logits, lmb), local_micro_batches=local)
            if it:  # the first round is warm-up
                timings[name]["step"].append(time.perf_counter() - t0)
                timings[name]["recompute"].append(t_re)
                timings[name]["prepare"].append(t_prep)

    med = {n: {k: statistics.median(v) * 1e3 for k, v in t.items()} for n, t in timings.items()}
    tokens = sum(int(mb["tokens"].numel()) for mb in batch)
    print(f"tiny GPT: hidden {args.hidden}, {args.layers} layers, vocab {cfg.vocab_size}; {args.micro_batches} "
          f"micro-batches, {tokens} tokens; {backend}, 1 thread; median of {args.steps} steps; loss: "
          + ("slime's custom loss (slime_rc.slime.policy_loss_function)" if args.loss == "slime" else "make_loss_func"))
    print(f"{'mode':<22}{'step ms':>10}{'recompute':>12}{'prepare':>10}")
    for name, m in med.items():
        print(f"{name:<22}{m['step']:>10.1f}{m['recompute']:>12.1f}{m['prepare']:>10.2f}")
    dec, byp = med["decoupled"]["step"], med["bypass + correction"]["step"]
    print(f"\nbypass + correction vs decoupled: {100 * (1 - byp / dec):.0f}% less step time ({dec / byp:.2f}x)")
    print(f"correction share, decoupled: prepare {100 * med['decoupled']['prepare'] / dec:.1f}% of the step; "
          f"vs standard {100 * (dec - med['standard']['step']) / dec:+.1f}%")
    print(f"correction share, bypass:    vs bypass plain "
          f"{100 * (byp - med['bypass plain']['step']) / byp:+.1f}% of the step")
    M.destroy_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
