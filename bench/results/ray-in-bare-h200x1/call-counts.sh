# The training thread's calls over 100 timed steps, bare and ray_zero, on the GPU. Needs call-counts.patch
# applied (git apply bench/results/ray-in-bare-h200x1/call-counts.patch); run from the repository root.
source scripts/gpu-env.sh
mkdir -p $OUT/counts/bare $OUT/counts/ray
CALL_COUNTS_DIR=$OUT/counts/bare python3 bench/bare_once.py experiments/quick.yaml --label counts-bare --set steps=120 --set warmup_steps=20 --set live_metrics_every=1000 2>&1 | tail -1
CALL_COUNTS_DIR=$OUT/counts/ray python3 -m ray_zero sweep experiments/quick.yaml --set steps=120 --set warmup_steps=20 --set live_metrics_every=1000 --set 'grid.stage=[1]' --set 'grid.num_workers=[1]' --output /tmp/counts-ray 2>&1 | grep "ok;"
ls $OUT/counts/*
