#!/usr/bin/env bash
# The mismatch study of docs/results.md: GRPO on the embedded task under a strong injected train/rollout mismatch
# (rollout logit noise 1.0 on improbable tokens + rollouts one weight sync stale), 3 seeds per configuration, plus a
# no-mismatch reference.  Usage: bash examples/mismatch_study.sh [OUT_DIR] [PARALLEL_JOBS]
set -euo pipefail
OUT=${1:-runs/study}
JOBS=${2:-2}
ONLY=${3:-}  # optional: a space-separated subset of the configurations
MISMATCH="--logit-noise 1.0 --stale-steps 1"
declare -A CONFIGS=(
  [reference]="--rollout-dtype fp32 --get-mismatch-metrics"
  [no_correction]="$MISMATCH --get-mismatch-metrics"
  [token_tis]="$MISMATCH --use-tis"
  [seq_mis]="$MISMATCH --rollout-correction-preset decoupled_seq_is_rs"
  [geo_rs]="$MISMATCH --rollout-correction-preset decoupled_geo_rs --rs-upper-bound 0.8_1.25"
  [bypass_pg_is]="$MISMATCH --rollout-correction-preset bypass_pg_is"
)
mkdir -p "$OUT"
for name in "${!CONFIGS[@]}"; do
  [[ -z "$ONLY" || " $ONLY " == *" $name "* ]] || continue
  for seed in 0 1 2; do
    echo "slime-rc train --seed $seed ${CONFIGS[$name]} --output-dir $OUT/$name/seed$seed > $OUT/$name.seed$seed.log 2>&1"
  done
done | xargs -P "$JOBS" -I{} bash -c "{}"
slime-rc plot "$OUT"/*/seed0 -o "$OUT/curves.png" || true
python -m slime_rc.demo.train.study "$OUT"
