#!/bin/bash
cd .
for i in 1 2 3; do
  for mode in false true; do
    out=OUT/$mode-$i
    rm -rf $out
    s=$(date +%s.%N)
    python -m ray_zero sweep experiments/quick.yaml --set controller_in_trial_driver=$mode --output $out > $out.log 2>&1
    rc=$?
    e=$(date +%s.%N)
    echo "controller_in_trial_driver=$mode run=$i rc=$rc wall=$(echo "$e - $s" | bc)"
  done
done
