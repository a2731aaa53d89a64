# The committed GPU results (results/): run on the lent 2 x H200 machine, from the repository root.
set -u
source scripts/gpu-env.sh
R=$(mktemp -d /tmp/res.XXXX)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
run() { local name=$1; shift; timeout ${T:-300} python3 -m ray_zero sweep "$@" --output $R/$name > $R/$name.log 2>&1; echo "$name rc=$?"; grep -E "^ray_zero" $R/$name.log; }
run zero1_mnist-h200 experiments/zero1_mnist.yaml
run memory_scaling-h200x2 experiments/memory_scaling.yaml
run oom_probe-h200 experiments/oom_probe.yaml
cd $R && tar czf $OUT/res.tgz --exclude='tune' --exclude='train' .
