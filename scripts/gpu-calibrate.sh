# First GPU look (exploratory): seed replication, large preset on 1-2 GPUs, an OOM trial.
set -u
source scripts/gpu-env.sh
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
python3 -c "import ray, deepspeed, torch; print(ray.__version__, deepspeed.__version__, torch.__version__)" >> $R/gpu.txt 2>&1
run() { local name=$1; shift; timeout ${T:-240} python3 -m ray_zero sweep "$@" --output $R/$name > $R/$name.log 2>&1; echo "$name rc=$?"; grep -E "^ray_zero|Error" $R/$name.log | head -30; }
run zero1_mnist experiments/zero1_mnist.yaml
run scaling experiments/memory_scaling.yaml --set 'grid.num_workers=[1,2]'
T=150 run oom experiments/memory_scaling.yaml --set 'grid.num_workers=[1]' --set 'grid.stage=[0]' --set 'grid.micro_batch_size=[16384]' --set steps=8
cd $R && tar czf $OUT/res.tgz --exclude='tune' --exclude='train' .
