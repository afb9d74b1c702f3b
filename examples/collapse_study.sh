#!/usr/bin/env bash
# The collapse study of docs/results.md: GRPO on 6-digit copy after a supervised warm start, with rollouts from an
# fp32 engine that keeps a probability floor of 2e-3 on every vocabulary entry (--rollout-prob-floor: it keeps
# sampling tail tokens the trainer drives towards 0), SEEDS seeds per configuration, plus a reference without the
# mismatch.  Then the study's table and curves, and `slime-rc analyze` of a collapsed no-correction run's dump.
#
# Usage: bash examples/collapse_study.sh [OUT_DIR] [PARALLEL_JOBS] [SEEDS] ["CONFIG ..."]
#   e.g. bash examples/collapse_study.sh runs/collapse 2 5            (55 runs; ~25 min on 2 CPU cores)
# Another engine and mismatch: ENGINE (flags added to every run) and MISMATCH (the mismatch's flags, in every row but
# the reference, after the base's --rollout-dtype fp32), e.g. the real vLLM engine in bf16 against fp32 vLLM:
#   ENGINE="--rollout-engine vllm" MISMATCH="--rollout-dtype bf16" bash examples/collapse_study.sh runs/collapse_vllm 2 5
set -euo pipefail
OUT=${1:-runs/collapse}
JOBS=${2:-2}
SEEDS=${3:-5}
ONLY=${4:-}  # optional: a space-separated subset of the configurations
RC=${SLIME_RC:-python -m slime_rc}  # the slime-rc command (run from the repository root, or set SLIME_RC=slime-rc)
# the regime: 6-digit copy, 60 supervised warm-start steps, then 120 GRPO steps of 16 prompts x 8 samples at lr 1e-2
BASE="--digits 6 --warm-start-steps 60 --num-steps 120 --prompts-per-step 16 --group-size 8 --lr 1e-2"
BASE="$BASE --rollout-dtype fp32 --no-use-tensorboard ${ENGINE:-}"
MISMATCH=${MISMATCH:-"--rollout-prob-floor 2e-3"}
CONFIGS=(reference no_correction token_tis seq_mis geo_rs bypass_pg_is veto bypass_pg_none seq_mis_veto seq_is seq_is_veto)
declare -A FLAGS=(
  [reference]="--get-mismatch-metrics"                                   # no mismatch: rollouts = the trainer's policy
  [no_correction]="$MISMATCH --get-mismatch-metrics"                     # metrics only: loss bit-identical to none
  [token_tis]="$MISMATCH --use-tis"                                      # decoupled PPO + token TIS (cap 2)
  [seq_mis]="$MISMATCH --rollout-correction-preset decoupled_seq_is_rs"  # sequence IS (cap 2) + sequence RS [0.5, 2]
  [geo_rs]="$MISMATCH --rollout-correction-preset decoupled_geo_rs --rs-upper-bound 0.8_1.25"  # + veto 1e-4
  [bypass_pg_is]="$MISMATCH --rollout-correction-preset bypass_pg_is"    # bypass REINFORCE + sequence IS (cap 2)
  [veto]="$MISMATCH --rs-veto-threshold 1e-4"                            # decoupled PPO + veto only
  # controls: bypass REINFORCE without IS (is bypass_pg_is stable for its loss or its weights?), and what slime-rc
  # analyze recommended on a collapsed no-correction dump before its Seq-TIS rule (seq-MIS + veto 1e-4)
  [bypass_pg_none]="$MISMATCH --use-rollout-logprobs --rollout-correction-loss-type reinforce --get-mismatch-metrics"
  [seq_mis_veto]="$MISMATCH --rollout-correction-preset decoupled_seq_is_rs --rs-veto-threshold 1e-4"
  # sequence IS without RS: what analyze recommends on that dump (severe, but no high-weight tail for Seq-MIS to
  # filter, and a veto that would drop 17% of samples sequence IS already weighs ~0; docs/analyze.md), and the same
  # with the veto
  [seq_is]="$MISMATCH --rollout-correction-preset decoupled_seq_is"
  [seq_is_veto]="$MISMATCH --rollout-correction-preset decoupled_seq_is --rs-veto-threshold 1e-4"
)
for name in $ONLY; do
  [[ -n ${FLAGS[$name]+x} ]] || { echo "unknown configuration $name; give some of: ${!FLAGS[*]}" >&2; exit 2; }
done
mkdir -p "$OUT"
for seed in $(seq 0 $((SEEDS - 1))); do  # seed-major: an interrupted study has every configuration's first seeds
  for name in ${ONLY:-${CONFIGS[@]}}; do
    [[ -f "$OUT/$name/seed$seed/summary.json" ]] && continue  # finished before: rerunning the script resumes
    extra=""
    [[ $name == no_correction ]] && extra="--dump-logprobs $OUT/$name/seed$seed/dump"  # for slime-rc analyze
    echo "$RC train $BASE --seed $seed ${FLAGS[$name]} $extra --output-dir $OUT/$name/seed$seed --overwrite \
> $OUT/$name.seed$seed.log 2>&1"
  done
done | xargs -P "$JOBS" -I{} bash -c "{}"
$RC plot "$OUT" -o "$OUT/curves.png"
python -m slime_rc.demo.train.study "$OUT" | tee "$OUT/table.md"
# slime-rc analyze on the dump of the first no-correction seed that collapsed (final < 0.8 x best 10-step mean)
for seed in $(seq 0 $((SEEDS - 1))); do
  run="$OUT/no_correction/seed$seed"
  if [[ -f $run/summary.json ]] && python -c "import json,sys; sys.exit(not json.load(open('$run/summary.json'))['collapsed'])"; then
    $RC analyze "$run/dump" --plot "$OUT/analyze_seed$seed.png" | tee "$OUT/analyze_seed$seed.txt"
    break
  fi
done
