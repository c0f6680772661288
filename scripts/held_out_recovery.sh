#!/usr/bin/env bash
# The held-out recovery runs of docs/results/posttrain-recovery-ablation-cpu.md ("Held-out totals"), one unit
# after another on one CPU thread: for each pretraining seed, `laptop_task.py --hold-out` pretrains a model that
# never reads the held-out totals, post-trains its fusion 9,600 steps (the split task's recipe; variant
# `steps-x4`, named as in the ablation), evaluates the base at K = 1 and TADM and naive reuse at K = 1-4
# (sampling seeds 0, 1, 2) on the old prompts (every total, `eval/`) and then on the held-out prompts
# (`eval-held-out/`). laptop_task.py skips every stage and evaluation unit already done, so running this
# script again continues an interrupted run (a stage cut off midway starts that stage again).
#
#   OMP_NUM_THREADS=1 nohup scripts/held_out_recovery.sh > /dev/null 2>&1 &
#   tail runs/held-out/driver.log                         # one line per unit: start, end, exit status
#   python scripts/recovery_ablation.py --runs runs/held-out --held-out \
#       --out docs/results/posttrain-recovery-ablation-cpu/held-out        # the tables, when the runs are done
#
# Settings (environment): RUNS (runs/held-out), SEEDS (0 1 3: the pretraining seeds that learned the task
# before), EXTRA_SEEDS (4 5: tried in turn, after SEEDS, while fewer than three seeds learned, i.e. answered at
# least LEARNED of the pretraining probe's 100 problems at K = 1; LEARNED 0.15), PYTHON (python).
set -u
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/held-out}
SEEDS=${SEEDS:-"0 1 3"}
EXTRA_SEEDS=${EXTRA_SEEDS:-"4 5"}
LEARNED=${LEARNED:-0.15}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's tadm
mkdir -p "$RUNS"
LOG="$RUNS/driver.log"

say() { echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $*" >> "$LOG"; }

unit() {  # unit SEED EVAL_SET: one laptop_task.py invocation, logged with its commit and wall time
  local seed=$1 set=$2 started rc
  started=$(date +%s)
  say "start seed-$seed eval-set $set commit $(git rev-parse HEAD) changed-files $(git status --porcelain --untracked-files=no | wc -l)"
  mkdir -p "$RUNS/seed-$seed"
  "$PYTHON" scripts/laptop_task.py --hold-out --model-seed "$seed" --out "$RUNS/seed-$seed" --refresh 1,2,3,4 \
    --variant steps-x4 --posttrain-steps 9600 --eval-set "$set" >> "$RUNS/seed-$seed/$set.log" 2>&1
  rc=$?
  say "end seed-$seed eval-set $set exit $rc wall $(( $(date +%s) - started )) s"
  return $rc
}

probe() {  # the pretrained base's accuracy at K = 1 on the probe's problems
  "$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['accuracy'])" \
    "$RUNS/seed-$1/eval-pretrained/units/split/baseline-K1-seed0.json" 2>/dev/null || echo 0
}

learned=0
say "driver start (pid $$): seeds $SEEDS, extra seeds $EXTRA_SEEDS"
for seed in $SEEDS $EXTRA_SEEDS; do
  if [ "$learned" -ge 3 ]; then break; fi
  unit "$seed" task || { say "driver stops: seed-$seed failed (see $RUNS/seed-$seed/task.log)"; exit 1; }
  accuracy=$(probe "$seed")
  if "$PYTHON" -c "import sys; sys.exit(float(sys.argv[1]) < float(sys.argv[2]))" "$accuracy" "$LEARNED"; then
    learned=$((learned + 1))
    say "seed-$seed learned (probe accuracy $accuracy)"
  else
    say "seed-$seed did not learn (probe accuracy $accuracy < $LEARNED); evaluated all the same"
  fi
  unit "$seed" held-out || { say "driver stops: seed-$seed failed (see $RUNS/seed-$seed/held-out.log)"; exit 1; }
done
say "driver done: $learned seeds learned"
