"""What a rank measures: memory after each phase and at its peak, bytes saved for backward, the rate of
its timed steps. Plain torch, no Ray. Keys carry their unit (`_gib`, `_bytes`, `_s`).

GPU memory is the CUDA caching allocator's (allocated and reserved); on CPU it is the process's
resident set (Python, torch and Ray included), whose peak (VmHWM) is reset through
/proc/self/clear_refs so that "peak over the timed steps" means the same thing on both.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any, Iterator, Optional

import torch

from ray_zero.measure.prediction import GIB

_HOPPER = {"fp16": 989.0, "bf16": 989.0, "fp32": 67.0}
_HOPPER_NVL = {"fp16": 835.0, "bf16": 835.0, "fp32": 60.0}
_A100 = {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5}
_V100_SXM2, _V100_PCIE = {"fp16": 125.0, "fp32": 15.7}, {"fp16": 112.0, "fp32": 14.0}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _HOPPER,  # SXM5
    "NVIDIA H100 PCIe": {"fp16": 756.0, "bf16": 756.0, "fp32": 51.0},
    "NVIDIA H100 NVL": _HOPPER_NVL,
    "NVIDIA H200": _HOPPER,  # SXM
    "NVIDIA H200 NVL": _HOPPER_NVL,
    "NVIDIA GH200 480GB": _HOPPER,
    "NVIDIA B200": {"fp16": 2250.0, "bf16": 2250.0},
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": {"fp16": 362.0, "bf16": 362.0, "fp32": 91.6},
    "NVIDIA L40": {"fp16": 181.0, "bf16": 181.0, "fp32": 90.5},
    "NVIDIA L4": {"fp16": 121.0, "bf16": 121.0, "fp32": 30.3},
    "NVIDIA A10": {"fp16": 125.0, "bf16": 125.0, "fp32": 31.2},
    "Tesla V100-SXM2-16GB": _V100_SXM2,
    "Tesla V100-SXM2-32GB": _V100_SXM2,
    "Tesla V100-PCIE-16GB": _V100_PCIE,
    "Tesla V100-PCIE-32GB": _V100_PCIE,
    "Tesla T4": {"fp16": 65.0, "fp32": 8.1},
}
"""Dense peak TFLOP/s (tensor cores for fp16/bf16, no sparsity; fp32 without TF32, torch's default for
matmuls) of common data-centre GPUs, from the vendors' data sheets, by the exact name CUDA and NVML
give the device. A name not here (another GPU, a MIG slice of one) and a precision a GPU lacks get no
MFU: the rank says why."""


def peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """The device's dense peak TFLOP/s at `precision`, by its exact name; None where not known."""
    return PEAK_TFLOPS.get(device_name, {}).get(precision)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a host clock read after it means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLEAR_REFS = "/proc/self/clear_refs"
"""Where Linux resets a process's peak resident set (a CPU rank's peak)."""


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class Memory:
    """Current and peak memory of this rank, with a peak that can be reset."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda" if device.type == "cuda" else "cpu_rss"
        self.reset_failed = False
        """A reset of the peak was refused: later peaks include what came before it."""

    def _cuda(self, which: str) -> dict[str, float]:
        # One call for both figures: memory_allocated() and its kin flatten every statistic each time.
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)  # {} before CUDA starts
        return {
            f"{kind}_gib": stats[f"{kind}_bytes"]["all"][which] / GIB if stats else 0.0
            for kind in ("allocated", "reserved")
        }

    def current(self) -> dict[str, float]:
        if self.kind == "cuda":
            return self._cuda("current")
        rss = _proc_status_kib("VmRSS") * 1024 / GIB
        return {"allocated_gib": rss, "reserved_gib": rss}

    def peak(self) -> dict[str, float]:
        if self.kind == "cuda":
            return self._cuda("peak")
        hwm = _proc_status_kib("VmHWM") * 1024 / GIB
        return {"allocated_gib": hwm, "reserved_gib": hwm}

    def reset_peak(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open(CLEAR_REFS, "w") as clear:
                clear.write("5")  # 5 = reset the peak resident set size (VmHWM)
        except OSError:  # not permitted here: the peaks then include start-up, and the row says so
            self.reset_failed = True

    def device_total_gib(self) -> Optional[float]:
        if self.kind == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory / GIB
        return None

    def nvml_used_gib(self) -> Optional[float]:
        """This process's memory as nvidia-smi shows it (CUDA context included), or None."""
        if self.kind != "cuda":
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid() and process.usedGpuMemory is not None:
                    return process.usedGpuMemory / GIB
        except Exception:  # no NVML (driver library missing, an unusual container): leave it empty
            return None
        return None


class SavedForBackward:
    """Bytes of the tensors autograd saves for backward during a forward pass, each storage once and
    parameters left out (the module's own, frozen ones too, or the ones FSDP2 gathers; any leaf that
    requires gradients):
    the activations one micro-batch keeps (torch.autograd.graph.saved_tensors_hooks). What is packed is
    a detached view: an output packed as itself refers to the node that saved it, a cycle through C++
    that Python's collector cannot see, so a forward that fails before its backward (out of memory)
    would keep every saved tensor alive."""

    def __init__(self):
        self._seen: set[tuple[str, int]] = set()
        self.bytes = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor  # a weight's transpose is a view of it
        # A frozen layer saves its weight for its input's gradient: a parameter, not an activation.
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return tensor
        try:
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
        except RuntimeError:  # a tensor subclass without storage of its own (a DTensor's wrapper)
            return tensor.detach()
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return tensor.detach()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield


class Meter:
    """One rank's measurements over a trial, as a flat dict (`result()`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.memory = Memory(device)
        self.figures: dict[str, Any] = {"memory_kind": self.memory.kind}
        self._whole_peak = {"allocated_gib": 0.0, "reserved_gib": 0.0}
        self._timed_from: Optional[float] = None
        self._window_from: Optional[tuple[float, int]] = None
        self._excluded_s = 0.0  # bookkeeping inside the timed window (live gauges): not timed
        self.window_rates: list[float] = []  # samples/s of each timed window of live_metrics_every steps
        self.memory.reset_peak()

    def after(self, phase: str) -> None:
        """Memory now, after a phase of the trial: model, data, initialize, first_backward, first_step."""
        synchronize(self.device)
        self.figures[f"memory_after_{phase}_gib"] = self.memory.current()["allocated_gib"]

    def peak_so_far_gib(self) -> float:
        return max(self._whole_peak["allocated_gib"], self.memory.peak()["allocated_gib"])

    def start_timing(self, step: int) -> None:
        """After warm-up: peaks so far include initialize and warm-up; the timed peak starts here."""
        synchronize(self.device)
        peak = self.memory.peak()
        self._whole_peak = {k: max(v, peak[k]) for k, v in self._whole_peak.items()}
        self.memory.reset_peak()
        self._timed_from = time.perf_counter()
        self._window_from = (self._timed_from, step)

    def end_window(self, step: int, samples_per_step: int) -> Optional[float]:
        """The rate of the timed steps since the last window, once the device has caught up (the
        caller's loss.item() waits for it); None before timing starts."""
        if self._window_from is None:
            return None
        now, (since, since_step) = time.perf_counter(), self._window_from
        rate = (step - since_step) * samples_per_step / max(now - since, 1e-9)
        self.window_rates.append(rate)
        self._window_from = (now, step)
        return rate

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Around bookkeeping between timed steps (publishing live gauges): its time is left out of the
        timed steps' and of the current window's."""
        if self._timed_from is None:  # not timing yet: nothing to leave out
            yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - started
            self._excluded_s += spent
            if self._window_from is not None:
                self._window_from = (self._window_from[0] + spent, self._window_from[1])

    def stop_timing(self, timed_steps: int, samples_per_step: int) -> None:
        synchronize(self.device)
        timed_s = time.perf_counter() - self._timed_from - self._excluded_s
        timed_peak = self.memory.peak()
        rates = self.window_rates or [float("nan")]
        deciles = statistics.quantiles(rates, n=10, method="inclusive") if len(rates) > 1 else [rates[0]] * 9
        self.figures.update(
            timed_steps=timed_steps,
            timed_s=timed_s,
            samples_per_s=timed_steps * samples_per_step / timed_s if timed_s > 0 else float("nan"),
            # The timed windows' median and 90th percentile: a rate that a shared host's hiccups move less.
            window_samples_per_s_median=deciles[4],
            window_samples_per_s_p90=deciles[8],
            peak_allocated_gib=max(self._whole_peak["allocated_gib"], timed_peak["allocated_gib"]),
            peak_reserved_gib=max(self._whole_peak["reserved_gib"], timed_peak["reserved_gib"]),
            timed_peak_allocated_gib=timed_peak["allocated_gib"],
            nvml_used_gib=self.memory.nvml_used_gib(),
            device_memory_gib=self.memory.device_total_gib(),
            peak_reset_failed=self.memory.reset_failed,
        )

    @contextlib.contextmanager
    def one_micro_batch(self) -> Iterator[None]:
        """Around one micro-batch's forward and backward: on GPU, how far its allocations rose above what
        was allocated before it (activations, the gradients it creates, the kernels' temporaries)."""
        if self.memory.kind != "cuda":
            yield
            return
        synchronize(self.device)
        self._whole_peak = {k: max(v, self.memory.peak()[k]) for k, v in self._whole_peak.items()}
        self.memory.reset_peak()
        before = self.memory.current()["allocated_gib"]
        yield
        synchronize(self.device)
        peak = self.memory.peak()
        self._whole_peak = {k: max(v, peak[k]) for k, v in self._whole_peak.items()}
        self.figures["micro_batch_rise_bytes"] = int((peak["allocated_gib"] - before) * GIB)

    def at_failure(self) -> dict[str, float]:
        """Peak and current memory at an out-of-memory error."""
        peak, current = self.memory.peak(), self.memory.current()
        return {
            "peak_allocated_gib": max(peak["allocated_gib"], self._whole_peak["allocated_gib"]),
            "peak_reserved_gib": max(peak["reserved_gib"], self._whole_peak["reserved_gib"]),
            "allocated_gib": current["allocated_gib"],
            "reserved_gib": current["reserved_gib"],
        }

    def result(self) -> dict[str, Any]:
        return dict(self.figures)
