"""`python -m ray_zero profile`: what one device reaches per kernel class, from micro-benchmarks alone (never
fitted to model runs), within a time budget; read by ray_zero/measure/gpu_profile.py. torch only.

Measured, each section in its share of the budget, its cases from small to large (a section stops where
the next case would not fit what is left of its share):
- matmul (torch.mm) over square, transformer-shaped (tokens x hidden) and vocabulary-head M, N, K, per dtype;
- scaled_dot_product_attention (causal, forward) over sequence lengths and head sizes: the kernel torch
  picks, FLOPs as torch's FLOP counter counts them (the full matrix: the causal saving is in the rate);
- convolutions (forward) of a few ResNet-shaped layers;
- elementwise (a multiply into another tensor) and reduction (a sum) bandwidth, by bytes, and random
  fills (bernoulli_, dropout's mask) by bytes written;
- torch.optim.AdamW's step, foreach (torch's default on CUDA) and fused, over fp32 parameters;
- the host's seconds per launched kernel for eager PyTorch: a loop of tiny in-place adds, timed on the
  host without waiting for the device;
- the host's seconds per module hook: calls of a module that launches nothing (nn.Identity) with and
  without no-op forward hooks, the difference per hook (the floor of an engine's hooks: DeepSpeed's and
  FSDP2's do more in theirs).

Each point is timed as REPEATS short repeats of the same number of calls, in two passes over the
sections (the second while the budget lasts, so that its repeats come a minute after the first's), and
keeps the fastest repeat (torch.utils.benchmark's practice on a noisy host: the other work of the
machine only adds time) beside the repeats' spread (IQR over median, and max over min, as
torch.utils.benchmark.Measurement computes them) and the two passes' ratio, so a reader sees which
points are noisy. On the shared 2-core machine, one mean of at most 100 calls per point moved up to
1,800x between two profiles two minutes apart, and five back-to-back repeats up to 1,348x.

A GPU repeat's device time is read between CUDA events, its calls queued behind a short sleep kernel so
that the host's launches do not show in it; on the CPU, perf_counter with the garbage collector off.
torch.utils.benchmark.Timer does not fit the timing itself: it reads a GPU with the host's clock and a
synchronize (small kernels at their launch cost), its timeit() adds two warm-up calls to every repeat (3x
a large case's time), and adaptive_autorange() sizes blocks at 10^4 x its timer's overhead with no
floor on their count under max_run_time.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import platform
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils.benchmark import Measurement
from torch.utils.benchmark.utils.common import TaskSpec

from ray_zero.measure.gpu_profile import FILE_KIND
from ray_zero.store import cpu_name
from ray_zero.train.profile_cases import CASES, DTYPES, adamw_cases, case_count

SHARES = {
    "launch": 0.05, "matmul": 0.28, "attention": 0.20, "conv": 0.10, "elementwise": 0.10, "reduction": 0.05,
    "random": 0.04, "adamw": 0.18,
}  # fmt: skip
"""Each section's share of the budget."""
SLEEP_CYCLES = 2_000_000
"""The sleep kernel the timed calls queue behind: about 1 ms on a GPU at 2 GHz."""
GROWTH = 4
"""About how much longer each case of a section takes than the one before it (its tensors made, its
calls timed)."""
REPEATS = 5
"""Repeats per point: the fastest is kept, their spread recorded."""
MAX_CALLS = {"cuda": 100, "cpu": 10_000}
"""Calls in one repeat at most; on a GPU, no more than its sleep kernel hides the launches of."""
HOOKS = 20
"""No-op forward hooks on the hooked module of hook_pairs."""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds per call of `calls` calls back to back, as the device runs them."""
    if device.type != "cuda":
        collecting = gc.isenabled()
        gc.disable()  # as timeit does: a collection is the host's, not the kernel's
        try:
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - started) / calls
        finally:
            if collecting:
                gc.enable()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)  # the device waits while the host queues the calls
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def repeats_summary(passes: list[tuple[list[float], int]], what: str = "") -> dict:
    """The fastest repeat's seconds per call over every pass (each: its repeats' seconds per call, and the
    calls in each), and the repeats' spread: {"seconds", "median_s", "iqr_over_median", "max_over_min",
    "repeats", "calls" (a pass's calls per repeat, by pass), "pass_ratio" (two passes: the second's
    fastest over the first's)}."""
    times = [t for pass_times, _ in passes for t in pass_times]
    task = TaskSpec(stmt=what or "fn()", setup="")
    measured = Measurement.merge(
        Measurement(calls, [t * calls for t in pass_times], task) for pass_times, calls in passes
    )[0]
    summary = {
        "seconds": min(times),
        "median_s": measured.median,
        "iqr_over_median": measured.iqr / measured.median,
        "max_over_min": max(times) / min(times),
        "repeats": len(times),
        "calls": [calls for _, calls in passes],
    }
    if len(passes) == 2:
        summary["pass_ratio"] = min(passes[1][0]) / min(passes[0][0])
    return summary


def repeat_times(fn: Callable[[], object], device: torch.device, target_s: float) -> tuple[list[float], int]:
    """One call's seconds in each of REPEATS repeats, and the calls in each: after a warm-up call (kernel
    choice, caches), as many calls a repeat as fill `target_s` / REPEATS (at most MAX_CALLS). A repeat
    under a quarter of that (the calls were counted from a disturbed, slow call) restarts the repeats
    with more calls; calls only grow, so the loop ends."""
    fn()
    _synchronize(device)
    repeat_s, most = target_s / REPEATS, MAX_CALLS["cuda" if device.type == "cuda" else "cpu"]
    calls, times = 1, []
    while len(times) < REPEATS:
        seconds = _timed(fn, calls, device)
        if calls < most and seconds * calls < repeat_s / 4:
            calls, times = min(most, max(2 * calls, int(repeat_s / max(seconds, 1e-9)))), []
            continue
        times.append(seconds)
    return times, calls


def seconds_per_call(fn: Callable[[], object], device: torch.device, target_s: float) -> dict:
    """One pass of repeat_times, as repeats_summary gives it."""
    return repeats_summary([repeat_times(fn, device, target_s)])


def launch_times(device: torch.device, launches: int = 500) -> tuple[list[float], int]:
    """The host's seconds per tiny in-place add, not waiting for the device (a GPU's queue holds them), in
    each of REPEATS repeats of `launches`, the device drained between them."""
    x = torch.zeros(1, device=device)
    for _ in range(20):
        x.add_(1)
    times = []
    for _ in range(REPEATS):
        _synchronize(device)
        started = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        times.append((time.perf_counter() - started) / launches)
    _synchronize(device)
    return times, launches


def hook_pairs(calls: int = 300) -> list[tuple[float, float]]:
    """REPEATS alternate pairs of a call's seconds: an nn.Identity with HOOKS no-op forward hooks, and a
    bare one."""
    bare, hooked, x = torch.nn.Identity(), torch.nn.Identity(), torch.zeros(1)
    for _ in range(HOOKS):
        hooked.register_forward_hook(lambda module, args, out: None)
    return [(_timed(lambda: hooked(x), calls, x.device), _timed(lambda: bare(x), calls, x.device))
            for _ in range(REPEATS)]  # fmt: skip


def hook_summary(passes: list[list[tuple[float, float]]], calls: int = 300) -> dict:
    """The host's seconds per call of a no-op forward hook: the fastest hooked repeat less the fastest bare
    one (the host's other work only adds), per hook; the spread is that of the pairs' differences."""
    per_hook = [[max(h - b, 1e-9) / HOOKS for h, b in pairs] for pairs in passes]
    summary = repeats_summary([(times, calls) for times in per_hook], "hooked(x) - bare(x)")
    fastest = min(h for pairs in passes for h, _ in pairs) - min(b for pairs in passes for _, b in pairs)
    return summary | {"seconds": max(fastest, 1e-9) / HOOKS}


def measure(device: torch.device, budget_s: float) -> dict:
    """The profile's figures: {"launch_s", "hook_s", "launch", "hook", "results": [{"kind", "dtype", "shape",
    "flops", "bytes", "seconds", "median_s", "iqr_over_median", "max_over_min", "repeats", "calls",
    "pass_ratio", ...}], "left_out": [{"kind", "dtype", "cases", "after"}]}; "seconds" is the fastest
    repeat's.

    Two passes. The first times each section's cases, small to large, within its share of `budget_s`
    (the larger cases not reached are left out, after the shape that was). The second times the same
    cases again, in the same order, while what is left of `budget_s` holds each case's first cost; a
    point keeps the fastest repeat of both. Its repeats are then a minute apart, not milliseconds: on a
    shared host a stall can last a whole section (2-thread CPU kernels at about 8 ms a call, whatever
    their size), and one pass cannot see past it."""
    deadline = time.perf_counter() + budget_s
    dtypes = ["bf16", "fp16", "fp32"] if device.type == "cuda" else ["fp32", "bf16"]
    launch, hooks = [launch_times(device)], [hook_pairs()]
    sections = [
        (kind, dtype, lambda k=kind, d=dtype: CASES[k](device, DTYPES[d]))
        for kind in CASES
        for dtype in dtypes
    ]
    adamw = ("foreach", "fused")
    sections += [(f"adamw_{kind}", "fp32", lambda k=kind: adamw_cases(device, k)) for kind in adamw]
    results, left_out, again = [], [], []
    for kind, dtype, cases in sections:
        share = budget_s * SHARES[kind.split("_")[0]] / (len(dtypes) if kind in CASES else 2)
        target_s = min(0.02, share / 20)
        started = case_started = time.perf_counter()
        points = []  # [row, first pass, its cost]
        try:
            for row, fn in cases():
                points.append([row, repeat_times(fn, device, target_s)])
                now = time.perf_counter()
                points[-1].append(now - case_started)
                if now - started + GROWTH * (now - case_started) > share:
                    left = case_count(kind.split("_")[0]) - len(points)
                    if left > 0:  # the next, larger case would overrun
                        left_out.append({"kind": kind, "dtype": dtype, "cases": left, "after": row["shape"]})
                    break
                case_started = now
        except (RuntimeError, torch.OutOfMemoryError) as error:  # a dtype or size this device refuses
            results.append({"kind": kind, "dtype": dtype, "error": str(error).splitlines()[0][:200]})
        finally:
            _synchronize(device)
        again.append((kind, dtype, cases, target_s, points))
    for kind, dtype, cases, target_s, points in again:
        second = _second_pass(cases, points, device, target_s, deadline)
        for (row, first, _), timing in zip(points, second):
            passes = [first, timing] if timing else [first]
            results.append({"kind": kind, "dtype": dtype, **row, **repeats_summary(passes)})
    launch.append(launch_times(device))
    hooks.append(hook_pairs())
    launch_figure, hook_figure = repeats_summary(launch, "x.add_(1)"), hook_summary(hooks)
    figures = {"launch_s": launch_figure["seconds"], "hook_s": hook_figure["seconds"]}
    return figures | {"launch": launch_figure, "hook": hook_figure, "results": results, "left_out": left_out}


def _second_pass(cases, points: list, device: torch.device, target_s: float, deadline: float) -> list:
    """The first pass's points of a section timed again, small to large, each while its first cost fits
    before `deadline`: repeat_times of each, None for those not reached."""
    timed, made = [], cases()
    try:
        for _, _, cost in points:
            if time.perf_counter() + cost > deadline:
                break
            _, fn = next(made)
            timed.append(repeat_times(fn, device, target_s))
    except (RuntimeError, torch.OutOfMemoryError):  # the first pass timed it: keep that
        pass
    finally:
        made.close()  # its tensors go
        _synchronize(device)
    return timed + [None] * (len(points) - len(timed))


def hardware(device: torch.device) -> dict:
    """The device's name and driver (the GPU's, through NVML), and the host's CPU."""
    cpu = cpu_name()
    found = {"name": cpu, "cpu": cpu}
    if device.type == "cuda":
        found["name"] = torch.cuda.get_device_name(device)
        found["memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
        found["cuda"] = torch.version.cuda
        try:
            import pynvml

            pynvml.nvmlInit()
            found["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as error:  # no NVML: the name is still torch's
            found["driver"] = f"unknown ({type(error).__name__})"
    return found


def write_profile(path: Path, device: str, budget_s: float, command: str) -> Path:
    """Measure `device` ("cuda" or "cpu") within `budget_s` and write the profile, with its hardware,
    versions, date and command."""
    where = torch.device(device)
    started = time.perf_counter()
    figures = measure(where, budget_s)
    content = {
        "kind": FILE_KIND,
        "device": where.type,
        "hardware": hardware(where),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {"python": platform.python_version(), "torch": str(torch.__version__)},
        "command": command,
        "budget_s": budget_s,
        "timing": f"each point: the fastest of {REPEATS} repeats in each of 2 passes (the second while the "
        "budget lasts); calls: a repeat's, by pass; spread: over all its repeats",
        "seconds": time.perf_counter() - started,
        **figures,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1) + "\n")
    return path
