"""Print a taskset CPU list: the first N CPUs of each GPU's NUMA-local CPU list (from sysfs), no CPU twice.

    python3 scripts/gpu_local_cpus.py 4      # e.g. 0,1,2,3,16,17,18,19 on a 2-GPU machine
Pinning both launchers of bench/bench.py to the same CPUs takes where the scheduler puts them out of a
host-bound model's samples/s.
"""
import subprocess
import sys


def parse(cpulist: str) -> list[int]:
    cpus = []
    for part in cpulist.strip().split(","):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


def main(per_gpu: int) -> None:
    bus_ids = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout.split()
    chosen: list[int] = []
    for bus_id in bus_ids:
        # nvidia-smi: 00000000:18:00.0; sysfs: 0000:18:00.0
        local = parse(open(f"/sys/bus/pci/devices/{bus_id[-12:].lower()}/local_cpulist").read())
        chosen += [cpu for cpu in local if cpu not in chosen][:per_gpu]
    print(",".join(map(str, chosen)))


if __name__ == "__main__":
    main(int(sys.argv[1]))
