# Why is a ZeRO-1 2-GPU trial slower under Ray Train than bare? On the lent 2 x H200 machine:
# bare runs with Ray Train's process-group and thread set-up switched on one at a time, then the
# same grid point as a ray_zero trial with the controller polling every 0.25 s and every 2 s.
#   bash scripts/gpu-diagnose.sh
set -u
source scripts/gpu-env.sh
R=$(mktemp -d /tmp/diag.XXXX)
python3 -c "import torch, deepspeed, ray.train.torch"   # compile and cache the imports once
bare() {  # experiment, label, overrides...
  local exp=$1 label=$2; shift 2
  python3 bench/bare_once.py "$exp" --label "$label" --workers 2 $(printf -- '--set %s ' "$@") 2>>$R/bare.err | tee -a $R/bare.txt
}
sweep() {  # experiment, label, overrides...
  local exp=$1 label=$2; shift 2
  python3 -m ray_zero sweep $exp --set 'grid.stage=[1]' --set 'grid.num_workers=[2]' "$@" --output $R/$label > $R/$label.log 2>&1
  echo "$label: $(grep '^ray_zero: stage' $R/$label.log)" | tee -a $R/bare.txt
}
L="experiments/memory_scaling.yaml"; LS="steps=60 warmup_steps=10"
S="experiments/quick.yaml"; SS="steps=300 warmup_steps=20"
for v in "" BARE_LAZY_PROCESS_GROUP=1 BARE_TRAIN_THREAD=1; do
  ( if [ -n "$v" ]; then export "$v"; fi
    bare $L "large bare ${v:-default}" $LS
    bare $S "seed bare ${v:-default}" $SS )
done
sweep $L large-ray-poll0.25 --set steps=60 --set warmup_steps=10
sweep $S seed-ray-poll0.25 --set steps=300 --set warmup_steps=20
RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=2 sweep $S seed-ray-poll2 --set steps=300 --set warmup_steps=20
bare $S "seed bare default again" $SS
cd $R && tar czf $OUT/diag.tgz --exclude='tune' --exclude='train' .
