# On the lent GPU machine: the VM's memory and CPU set-up (system.txt); the speed probe in plain processes
# before and after (plain-probe.txt); between them alternating bare / ray_zero pairs with
# RAY_ZERO_SPEED_PROBE=1 (ray_zero/speed_probe.py: fixed work timed in each rank after its timed steps),
# the benchmark on CPUs 0-13 and bench/speed_monitor.py tracing the host's speed on CPUs 14 and 15.
#   bash scripts/gpu-speed-probe.sh PAIRS STEPS      # e.g. 5 820
set -u
source scripts/gpu-env.sh
{ for f in enabled defrag; do echo "transparent_hugepage/$f: $(cat /sys/kernel/mm/transparent_hugepage/$f)"; done
  lscpu; grep -iE "huge|MemTotal|MemFree" /proc/meminfo; cat /proc/buddyinfo; } > $OUT/system.txt 2>&1
probe() { python3 -c "from ray_zero import speed_probe; print('$1', speed_probe.measure())" >> $OUT/plain-probe.txt 2>&1; }
probe before; probe before
taskset -c 14 python3 bench/speed_monitor.py $OUT/monitor-cpu14.csv & M1=$!
taskset -c 15 python3 bench/speed_monitor.py $OUT/monitor-cpu15.csv & M2=$!
RAY_ZERO_SPEED_PROBE=1 taskset -c 0-13 bash scripts/gpu-bench.sh throughput experiments/quick.yaml \
  --set 'grid.stage=[1]' --set steps=$2 --set warmup_steps=20 --set 'grid.num_workers=[1]' --throughput $1
kill $M1 $M2
probe after
tar xzf $OUT/bench.*.tgz -C /tmp ./throughput/throughput.csv && for cpu in 14 15; do
  echo "== monitor on CPU $cpu"; python3 bench/speed_monitor.py $OUT/monitor-cpu$cpu.csv --analyse /tmp/throughput/throughput.csv
done
