# On the lent GPU machine: the VM's memory and CPU set-up (system.txt), the speed probe in plain processes
# before and after (plain-probe.txt), and between them alternating bare / ray_zero pairs with
# RAY_ZERO_SPEED_PROBE=1 (ray_zero/speed_probe.py: fixed work timed in each rank after its timed steps).
#   bash scripts/gpu-speed-probe.sh PAIRS STEPS      # e.g. 5 820
set -u
source scripts/gpu-env.sh
{ for f in enabled defrag; do echo "transparent_hugepage/$f: $(cat /sys/kernel/mm/transparent_hugepage/$f)"; done
  lscpu; grep -iE "huge|MemTotal|MemFree" /proc/meminfo; cat /proc/buddyinfo; } > $OUT/system.txt 2>&1
probe() { python3 -c "from ray_zero import speed_probe; print('$1', speed_probe.measure())" >> $OUT/plain-probe.txt 2>&1; }
probe before; probe before
RAY_ZERO_SPEED_PROBE=1 bash scripts/gpu-bench.sh throughput experiments/quick.yaml --set 'grid.stage=[1]' \
  --set steps=$2 --set warmup_steps=20 --set 'grid.num_workers=[1]' --throughput $1
probe after
