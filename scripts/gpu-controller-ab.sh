# Cut 10 on the lent GPU machine: a sweep's first trial (1 GPU, seed model) against bare DeepSpeed, with
# Ray Train's controller in Tune's trial driver (true) or in its own actor (false), in turn in one call.
#   bash scripts/gpu-controller-ab.sh "true false" 3    # each mode: 3 bare/ray_zero pairs, alternating
set -u
source scripts/gpu-env.sh
R=$(mktemp -d /tmp/bench.XXXX)
python3 -c "import torch, deepspeed, ray.train.torch"   # compile and cache the imports once, for both sides
for mode in $1; do
  timeout 290 python3 bench/bench.py experiments/quick.yaml --set 'grid.stage=[1]' --set steps=220 \
    --set warmup_steps=20 --set 'grid.num_workers=[1]' --set controller_in_trial_driver=$mode \
    --throughput $2 --output $R/controller-$mode-$(date +%H%M%S) > $R/controller-$mode.log 2>&1
  echo "controller_in_trial_driver=$mode rc=$?"
done
grep -h -E "^\| stage|Error" $R/*/throughput.md $R/*.log 2>/dev/null | cut -c1-200 | tail -40
# Ray Train's own timing of each run's worker-group start, callback by callback (its controller's system log).
for log in $(ls -tr /tmp/ray/session_*/logs/train/ray-train-sys-controller-*.log); do
  echo "$log"; grep -h -E "worker actors created|after_worker_group_start callbacks completed" "$log"
done > $R/worker-group-start.log
cd $R && tar czf $OUT/$(basename $R).tgz --exclude='tune' --exclude='train' .
