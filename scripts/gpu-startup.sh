# Start-up profile and the seed-model bench on the lent 2 x H200 machine (bench/README.md).
#   bash scripts/gpu-startup.sh
set -u
source scripts/gpu-env.sh
R=$(mktemp -d /tmp/r.XXXX)
( time python3 -c "import torch, deepspeed, ray.train.torch" ) 2>&1 | tail -3
( time python3 -c "import torch, deepspeed, ray.train.torch" ) 2>&1 | tail -3
nproc; free -g | head -2
timeout 150 python3 bench/startup_profile.py experiments/quick.yaml --set 'grid.stage=[1]' --set 'grid.num_workers=[2]' --output $R/startup-seed-w2 > $R/startup.log 2>&1; echo "profile rc=$?"
timeout 380 python3 bench/bench.py experiments/quick.yaml --set steps=300 --set warmup_steps=20 --output $R/seed-h200x2 > $R/seed.log 2>&1; echo "bench rc=$?"
grep -E "^\| |^ray_zero" $R/seed.log | tail -40
cd $R && tar czf $OUT/r.tgz --exclude='tune' --exclude='train' --exclude='*.pkl' .
