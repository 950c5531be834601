#!/bin/bash
# Exploration on a many-core machine: several `k3ir train` runs side by side, each pinned to
# its own 2 cores (taskset) with 2 torch threads, i.e. one uncontended "2-core CPU" per run.
# usage: bench/train_explore.sh OUTDIR STEPS "rule:scale rule:scale ..."
out=$1; steps=$2; shift 2
mkdir -p "$out"
i=0
for spec in $1; do
  rule=${spec%%:*}; scale=${spec##*:}
  c0=$((2*i)); c1=$((2*i+1))
  ( /usr/bin/time -f "%e s wall" taskset -c $c0,$c1 k3ir train --steps "$steps" --qb "$rule" --router-lr-scale "$scale" \
      --threads 2 --out "$out/$rule-$scale" --log-every 50 --ckpt-every 0 > "$out/$rule-$scale.log" 2>&1 ) &
  i=$((i+1))
done
wait
for f in "$out"/*.log; do echo "== $f"; grep -E "^step (1|50|100|150|200|250|300)/|done:|s wall" "$f"; done
