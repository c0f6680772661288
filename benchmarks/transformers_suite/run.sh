#!/usr/bin/env bash
# Run transformers' DiffusionGemma model tests on CPU against the base DiffusionGemmaForBlockDiffusion and then
# against tadm's TimeAnchoredDiffusionGemma at each K in $KS (default "1 3"); writes OUT/{base,k1,k3}.json
# (per-test summaries), .xml (JUnit), .log and OUT/table.md. See README.md for how SUITE is assembled.
#
#   SUITE=path/to/suite OUT=results ./run.sh
#
# Environment: SUITE (required: the assembled tests, with this folder's conftest.py and classification.json
# copied beside them), PY (default: python), SITE (extra PYTHONPATH entry holding `parameterized`), OUT (default
# ./results), KS, CLASS (default tadm.posttrain.hf_model:TimeAnchoredDiffusionGemma), SKIP_BASE=1.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
SRC="$(cd "$HERE/../../src" && pwd)"
: "${SUITE:?set SUITE to the assembled test folder (README.md)}"
PY=${PY:-python}
KS=${KS:-1 3}
CLASS=${CLASS:-tadm.posttrain.hf_model:TimeAnchoredDiffusionGemma}
OUT=${OUT:-results}
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
cp "$HERE/conftest.py" "$HERE/classification.json" "$SUITE/"

run_one() {  # label, class spec ("" = base), K
  local label=$1 class=$2 k=$3 t0
  t0=$(date +%s)
  (cd "$SUITE" && env -u TADM_HF_CLASS -u TADM_HF_K PYTHONPATH="${SITE:+$SITE:}$SRC:$SUITE" OMP_NUM_THREADS=1 \
      HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CUDA_VISIBLE_DEVICES="" \
      ${class:+TADM_HF_CLASS=$class TADM_HF_K=$k} TADM_HF_SUMMARY="$OUT/$label.json" \
      "$PY" -m pytest tests/models/diffusion_gemma -p no:cacheprovider -q -rfE \
      --junitxml="$OUT/$label.xml" >"$OUT/$label.log" 2>&1)
  echo "$label: $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/$label.log")" >&2
}

files=() labels=()
[ "${SKIP_BASE:-0}" = 1 ] || run_one base "" 1
files+=("$OUT/base.json"); labels+=("base")
for k in $KS; do
  run_one "k$k" "$CLASS" "$k"
  files+=("$OUT/k$k.json"); labels+=("K=$k")
done
"$PY" "$HERE/table.py" "${files[@]}" --labels "$(IFS=,; echo "${labels[*]}")" \
  --classification "$HERE/classification.json" >"$OUT/table.md"
echo "results in $OUT (table.md)" >&2
