"""Per-rank measurements: memory (CUDA allocator, NVML, CPU resident set), model-state bytes, timing.

All functions take plain torch objects; none imports Ray. Keys carry their unit (`_gib`, `_bytes`, `_s`).
"""
from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from ray_zero.cpu_counters import ThreadCounters

GIB = 1024 ** 3

# Dense peak TFLOP/s per GPU (no sparsity), from the vendors' data sheets, for MFU.
PEAK_TFLOPS = {
    "H200": {"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
    "H100": {"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
    "A100": {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5},
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    for key, table in PEAK_TFLOPS.items():
        if key in device_name:
            return table.get(precision)
    return None


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a host clock read after it means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------- memory

def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class MemoryProbe:
    """Current and peak memory of this rank, with peaks that can be reset.

    GPU: the CUDA caching allocator's allocated and reserved bytes. CPU: the process's resident
    set; its peak (VmHWM) is reset through /proc/self/clear_refs, so "peak over the timed steps"
    means the same thing on both.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda" if device.type == "cuda" else "cpu_rss"
        self._nvml = _NvmlProcessMemory(device) if device.type == "cuda" else None

    def _cuda_gib(self, which: str) -> dict[str, float]:
        """The caching allocator's allocated and reserved bytes, `which` = current or peak, in GiB. One
        call: torch's memory_allocated() and its kin flatten every statistic in Python first, which a
        rank publishing live peaks every few steps paid twice each time (py-spy on the H200:
        bench/results/throughput-seed-side-by-side-h200x2/thread-figures-unheld)."""
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)  # {} before CUDA starts: nothing yet
        return {f"{kind}_gib": stats[f"{kind}_bytes"]["all"][which] / GIB if stats else 0.0
                for kind in ("allocated", "reserved")}

    def current(self) -> dict[str, float]:
        if self.kind == "cuda":
            return self._cuda_gib("current")
        rss = _proc_status_kib("VmRSS") * 1024 / GIB
        return {"allocated_gib": rss, "reserved_gib": rss}

    def peak(self) -> dict[str, float]:
        if self.kind == "cuda":
            return self._cuda_gib("peak")
        hwm = _proc_status_kib("VmHWM") * 1024 / GIB
        return {"allocated_gib": hwm, "reserved_gib": hwm}

    def reset_peak(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as clear:
                    clear.write("5")  # 5 = reset the peak resident set size (VmHWM)
            except OSError:
                pass  # not permitted here: the timed peak then includes start-up

    def nvml_used_gib(self) -> float | None:
        """This process's memory as nvidia-smi shows it (CUDA context included), or None."""
        return self._nvml.used_gib() if self._nvml else None


class _NvmlProcessMemory:
    def __init__(self, device: torch.device):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            self._pynvml = pynvml
        except Exception:  # no NVML (driver library missing, or an unusual container): leave the column empty
            self.handle = None

    def used_gib(self) -> float | None:
        if self.handle is None:
            return None
        try:
            for proc in self._pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return proc.usedGpuMemory / GIB
        except self._pynvml.NVMLError:
            return None
        return None


# ------------------------------------------------------------------------- model-state bytes

def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _innermost_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """DeepSpeed wraps the torch optimizer (FP16_Optimizer, ZeRO, BF16_Optimizer): unwrap it."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer) and not isinstance(inner, torch.optim.Optimizer):
            return optimizer
        optimizer = inner
    return None


def _tensors_in(obj: Any, depth: int = 0, seen: set | None = None) -> Iterable[torch.Tensor]:
    """Tensors reachable from a DeepSpeed optimizer wrapper's attributes (lists, dicts, tensors)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value, depth + 1, seen)
    elif type(obj).__module__.startswith("deepspeed.runtime") and not isinstance(obj, torch.nn.Module):
        for value in vars(obj).values():
            yield from _tensors_in(value, depth + 1, seen)


def model_state_bytes(module: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds, by kind, counting each tensor storage once.

    parameter: the module's (low-precision) parameters; gradient: gradients of the module's
    parameters and of the fp32 master partition, and DeepSpeed's gradient partitions; master:
    the fp32 master copy this rank owns (none when the optimizer steps the module's own
    parameters); optimizer_state: the torch optimizer's states (Adam's two moments, step).
    other: any further tensor the DeepSpeed optimizer wrapper holds (buckets, flat buffers).
    """
    counted: set[tuple[str, int]] = set()
    result = {"parameter_bytes": 0, "gradient_bytes": 0, "master_param_bytes": 0,
              "optimizer_state_bytes": 0, "other_optimizer_bytes": 0}

    def add(kind: str, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" or tensor.numel() == 0:
            return
        key = _storage_key(tensor)
        if key not in counted:
            counted.add(key)
            result[kind] += _storage_bytes(tensor)

    module_params = list(module.parameters())
    for p in module_params:
        add("parameter_bytes", p.data)
    inner = _innermost_torch_optimizer(optimizer)
    if inner is not None:
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add("optimizer_state_bytes", value)
        for group in inner.param_groups:
            for p in group["params"]:
                add("master_param_bytes", p.data)  # no-op when p is a module parameter
    for p in module_params:
        if p.grad is not None:
            add("gradient_bytes", p.grad)
    if inner is not None:
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    add("gradient_bytes", p.grad)
    if optimizer is not None and optimizer is not inner:
        for name in ("averaged_gradients", "grads_in_partition", "fp32_groups_gradients_flat",
                     "fp32_groups_gradients"):
            for tensor in _tensors_in(getattr(optimizer, name, None)):
                add("gradient_bytes", tensor)
        for tensor in _tensors_in(optimizer):
            add("other_optimizer_bytes", tensor)
    return result


# ----------------------------------------------------------------------------------- timing

def thread_scheduling(tid: int | None = None, pid: int | None = None) -> tuple[float, int] | None:
    """A thread's time runnable but waiting for a core (s), and how often it gave up its core itself
    (blocked: on the GIL, the device, I/O), from Linux's /proc; None elsewhere. The calling thread, or
    thread `tid` of this process (or of process `pid`)."""
    folder = Path("/proc/thread-self") if tid is None else Path(f"/proc/{pid or 'self'}/task/{tid}")
    try:
        run_queue_ns = int((folder / "schedstat").read_text().split()[1])
        status = (folder / "status").read_text()
    except (OSError, IndexError, ValueError):
        return None
    voluntary = next(int(line.split()[1]) for line in status.splitlines()
                     if line.startswith("voluntary_ctxt_switches"))
    return run_queue_ns / 1e9, voluntary


def thread_migrations() -> int | None:
    """How often the scheduler has moved the calling thread to another CPU (its caches left behind),
    from Linux's /proc (kernels with scheduler statistics); None elsewhere."""
    try:
        for line in Path("/proc/thread-self/sched").read_text().splitlines():
            if line.startswith("se.nr_migrations"):
                return int(line.split(":")[1])
    except (OSError, ValueError):
        pass
    return None


def _stat_fields(thread: Path) -> list[str]:
    """A thread's /proc stat fields after its name (which may hold spaces and parentheses): [7] minor
    faults, [11] user and [12] kernel CPU time, in clock ticks."""
    return (thread / "stat").read_text().rsplit(")", 1)[1].split()


def thread_system_time_and_faults() -> tuple[float, int] | None:
    """The calling thread's CPU time in the kernel (s) and its minor page faults, from Linux's /proc;
    None elsewhere. The kernel's part of the thread's CPU time: system calls, faults (memory handed back
    and touched again), the device driver's ioctls."""
    try:
        fields = _stat_fields(Path("/proc/thread-self"))
        return int(fields[12]) / os.sysconf("SC_CLK_TCK"), int(fields[7])
    except (OSError, IndexError, ValueError):
        return None


def threads_cpu_s() -> dict[int, float] | None:
    """CPU time (user and kernel, s) of each live thread of this process, by thread id, from Linux's /proc;
    None elsewhere. For the threads beside the one that trains: autograd's device thread runs the backward
    pass there (and DeepSpeed's gradient hooks), Ray's own threads run beside it in a Ray rank."""
    ticks = os.sysconf("SC_CLK_TCK")
    result = {}
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            fields = _stat_fields(task)
        except (OSError, IndexError):
            continue  # the thread ended while this read the others
        result[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return result


def thread_name(tid: int, pid: int | None = None) -> str | None:
    """Thread `tid` of this process (or of process `pid`) by its Linux name (torch names autograd's device
    threads pt_autograd_N); None once it has ended."""
    try:
        return Path(f"/proc/{pid or 'self'}/task/{tid}/comm").read_text().strip()
    except OSError:
        return None


class StepTimer:
    """Wall time of the timed steps only, read after the device has finished its queued work; beside it,
    for the thread that trains: its CPU time (and the kernel's part of it, and its minor page faults), its
    time waiting for a core, how often it blocked; the CPU time of the process's other threads, in all and
    the busiest one's (threads that end before the timer stops are not counted); and the time Python's
    garbage collector ran (any thread).

    For a host-bound step these say where the time went: a training thread on the CPU for less than the
    wall time was waiting, for a core (`run_queue_s`) or blocked (on the device or the GIL; each block is
    a voluntary switch); a longer collector pauses every thread.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.started: float | None = None
        self.elapsed_s = 0.0
        self.thread_cpu_s = 0.0
        self.gc_s = 0.0
        self.run_queue_s: float | None = None
        self.voluntary_switches: int | None = None
        self.migrations: int | None = None
        self.thread_system_s: float | None = None
        self.minor_faults: int | None = None
        self.other_threads_cpu_s: float | None = None
        self.busiest_other_thread_cpu_s: float | None = None
        self.busiest_other_thread_name: str | None = None
        self.phase_s: dict[str, float] = {}  # host time by phase of the step, from lap()
        self.thread_cycles: int | None = None  # the training thread's, in user space (hardware counters)
        self.thread_instructions: int | None = None
        self._counters: ThreadCounters | None = None
        self._counted_from: tuple[int, int] = (0, 0)
        self._lap_at: float | None = None
        self._threads_started: dict[int, float] | None = None
        self._thread_cpu_started = 0.0
        self._kernel_started: tuple[float, int] | None = None
        self._sched_started: tuple[float, int] | None = None
        self._migrations_started: int | None = None
        self._gc_began: float | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self.gc_s += time.perf_counter() - self._gc_began
            self._gc_began = None

    def start(self) -> None:
        synchronize(self.device)
        gc.callbacks.append(self._on_gc)
        self._sched_started = thread_scheduling()
        self._migrations_started = thread_migrations()
        self._kernel_started = thread_system_time_and_faults()
        self._threads_started = threads_cpu_s()
        self._counters = ThreadCounters.open()
        if self._counters is not None:
            self._counted_from = self._counters.read()
        self._thread_cpu_started = time.thread_time()
        self.started = self._lap_at = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Adds the host time since the previous lap (or the start) to `phase`, between start and stop:
        where a host-bound step's time goes (backward, say, waits there for autograd's device thread)."""
        if self._lap_at is not None:
            now = time.perf_counter()
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + now - self._lap_at
            self._lap_at = now

    def stop(self) -> float:
        synchronize(self.device)
        self._lap_at = None
        if self.started is not None:
            self.elapsed_s = time.perf_counter() - self.started
            self.thread_cpu_s = time.thread_time() - self._thread_cpu_started
            if self._counters is not None:
                counted = self._counters.read()
                self.thread_cycles = counted[0] - self._counted_from[0]
                self.thread_instructions = counted[1] - self._counted_from[1]
            ended = thread_scheduling()
            if self._sched_started and ended:
                self.run_queue_s = ended[0] - self._sched_started[0]
                self.voluntary_switches = ended[1] - self._sched_started[1]
            migrations = thread_migrations()
            if self._migrations_started is not None and migrations is not None:
                self.migrations = migrations - self._migrations_started
            kernel_ended = thread_system_time_and_faults()
            if self._kernel_started and kernel_ended:
                self.thread_system_s = kernel_ended[0] - self._kernel_started[0]
                self.minor_faults = kernel_ended[1] - self._kernel_started[1]
            threads_ended = threads_cpu_s()
            if self._threads_started is not None and threads_ended:
                me = threading.get_native_id()
                others = {tid: cpu - self._threads_started.get(tid, 0.0) for tid, cpu in threads_ended.items()
                          if tid != me}
                self.other_threads_cpu_s = sum(others.values())
                busiest = max(others, key=others.get, default=None)
                self.busiest_other_thread_cpu_s = others[busiest] if busiest is not None else 0.0
                self.busiest_other_thread_name = thread_name(busiest) if busiest is not None else None
        if self._counters is not None:
            self._counters.close()
            self._counters = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        return self.elapsed_s
