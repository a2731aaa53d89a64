"""fit's search on the ranks of one run: every probe a fresh engine, torn down before the next.

`run_search` runs one search (ray_zero/measure/search.py) to its end on this rank: for each micro-batch the
search asks for it trains the probe's few steps exactly as a trial's rank does (`ray_zero.train.worker.train`,
which resets the peak), hands the rank's measurements to `on_probe`, and tears the engine down (its
tensors freed, cycles collected, the CUDA cache emptied, or on CPU the freed heap handed back to the
system: glibc keeps it otherwise, and the next probe's resident set would start from this one's). All
ranks take the same decisions: each probe's figures are all-gathered, and the search records the largest
peak over ranks. Optionally the search's own calibration probes come first (their activations per sample
give the first guess on GPU), and the answer's timed run last. `run_searches` runs several searches
whose points share their workers one after another in the same process (fit on one GPU: every stage's
search in one run). No Ray here: the caller reports each probe (ray_zero/run/search_trial.py).

Out of memory inside the run: with one rank the probe's result says `oom`, the rank frees what it held
and goes on if the memory in use is back within `LEAK_TOLERANCE_BYTES` of what it was before the probe;
else `run_search` returns early (`"leak"`) and the caller goes on in a fresh run. With several ranks an
out-of-memory rank ends the run (its peers may be waiting in a collective), as does any other error.

CPU: the heap is trimmed after each probe, yet a probe after others may read more resident set than a
fresh run (glibc's mmap threshold only rises: later probes take more from the heap; how much:
bench/fit_bench.md). GPU: the caching allocator's peak, which a previous probe does not touch once its
blocks are freed and the cache emptied.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ray_zero.config import Experiment, TrialSpec
from ray_zero.measure import calibration
from ray_zero.measure.prediction import GIB
from ray_zero.models.describe import build_model_spec
from ray_zero.models.source import ModelSource
from ray_zero.models.spec import ModelSpec, copied
from ray_zero.train.search_spec import SearchSpec, calibration_probes
from ray_zero.train.worker import TrialOutOfMemory, train

LEAK_TOLERANCE_BYTES = 256 * 1024**2
"""How far above its pre-probe level the memory in use (GPU: allocated; CPU: resident set, after the heap
is trimmed) may stay once an out-of-memory probe is torn down, for the run to go on: above what a probe
leaves by design (GPU: cuBLAS's workspaces once made; CPU: a run's first probe's first-use allocations;
the sizes: bench/fit_bench.md)."""


def release(device: torch.device) -> None:
    """Give back what a torn-down probe held: collect its cycles (DeepSpeed's hooks and the engine refer
    to each other), empty the CUDA cache, or on CPU hand the heap's free pages back to the system."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the resident set keeps what the allocator keeps
        pass


def memory_in_use(device: torch.device) -> int:
    """Bytes this rank holds now: allocated on the GPU, or the process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096  # resident pages


class _Model:
    """The search's model, built once, before the first probe (its imports then count in no probe's
    leftovers). On a GPU a pristine copy stays on the host and each probe trains a copy of it. On CPU,
    where the resident set is what is measured, a kept copy would count in every probe's peak (a fresh
    run holds one model, not two): the first probe trains the model built here, and each later one
    builds it again, as a trial's rank does (seeded: the same weights). A probe at another seq_len than
    the one built (a seq_len axis, or fit --target seq_len) builds its own: its batches differ."""

    def __init__(self, experiment: Experiment, keep: bool, source: Optional[ModelSource] = None):
        torch.manual_seed(experiment.seed)  # as worker.train seeds before it builds
        self.source = source or experiment.model_source()
        self.built: Optional[ModelSpec] = build_model_spec(self.source)
        self.keep = keep

    def for_probe(self, source: Optional[ModelSource] = None) -> Optional[ModelSpec]:
        """A model for the next probe (of `source`: the built one's by default), or None: the rank builds
        it as a trial's rank does."""
        if self.built is None or (source is not None and source != self.source):
            return None
        if not self.keep:
            model, self.built = self.built, None
            return model
        try:
            return copied(self.built)
        except Exception:  # something in the model cannot be copied: build it afresh, as a trial does
            self.built = None
            return None


class Prober:
    """This rank's probes, one after another in one process: each trains in a fresh engine (and model) and
    is torn down before the next."""

    def __init__(
        self,
        experiment: Experiment,
        rank: int,
        world_size: int,
        device: torch.device,
        attempt: int = 1,
        keep_model: Optional[bool] = None,
        source: Optional[ModelSource] = None,
    ):
        """keep_model: build the model once and train a copy of it in each probe (default: on a GPU);
        source: the model to build (default: the experiment's)."""
        self.rank, self.world_size, self.device, self.attempt = rank, world_size, device, attempt
        import ray_zero.train.engines  # noqa: F401  DeepSpeed's and the engines' imports: no probe's leftovers

        keep = device.type == "cuda" if keep_model is None else keep_model
        self.model = _Model(experiment, keep, source)
        self.first_guess: Optional[int] = None
        """Written into every probe's result (where the search started)."""

    def probe(self, spec: TrialSpec) -> dict[str, Any]:
        """This rank's measurements of one probe: a trial rank's result dict, with `probe_status` (ok, or
        oom with one rank), `micro_batch_size`, `label`, `trial`, `first_guess` and `left_bytes` (memory
        in use after the teardown above what it was before the probe). Raises what the probe raised, an
        out-of-memory error too with several ranks."""
        release(self.device)
        before = memory_in_use(self.device)
        try:
            result = train(
                spec,
                self.rank,
                self.world_size,
                self.device,
                attempt=self.attempt,
                model=self.model.for_probe(spec.model_source()),
            )
            result["probe_status"] = "ok"
        except TrialOutOfMemory as error:
            if self.world_size > 1:
                raise  # a peer may be waiting in a collective: the run ends here
            result = {"probe_status": "oom", "error": str(error), **error.memory}
            error.__context__ = error.__traceback__ = None  # the failed step's frames hold its tensors
            del error
        release(self.device)
        result.update(
            micro_batch_size=spec.point.micro_batch_size,
            seq_len=spec.point.seq_len,
            label=spec.label,
            trial=spec.name,
            first_guess=self.first_guess,
            left_bytes=memory_in_use(self.device) - before,
        )
        return result


class _Leaked(Exception):
    """An out-of-memory probe left memory in use: this run's search stops here."""


def run_searches(
    searches: list[SearchSpec],
    rank: int,
    world_size: int,
    device: torch.device,
    on_probe: Callable[[dict[str, Any]], None],
    attempt: int = 1,
) -> str:
    """Run `searches` (one experiment, points that share their workers) one after another on this rank,
    in one process and from one model build: a run's start is paid once for them all. Each probe's
    result says its search (`search`: SearchSpec.name). Returns "done", or "leak" at the first search that
    must go on in a fresh run (it and those after it are left to that run)."""
    first = searches[0].spec
    prober = Prober(first.experiment, rank, world_size, device, attempt, source=first.model_source())
    for search in searches:
        if run_search(search, rank, world_size, device, on_probe, attempt, prober) == "leak":
            return "leak"
    return "done"


def run_search(
    search: SearchSpec,
    rank: int,
    world_size: int,
    device: torch.device,
    on_probe: Callable[[dict[str, Any]], None],
    attempt: int = 1,
    prober: Optional[Prober] = None,
) -> str:
    """Run `search` on this rank: calibration probes (if asked), the probes, the timed run. `on_probe(result)`
    gets each probe's measurements of this rank (`Prober.probe`); every rank calls it as often. Returns
    "done", or "leak": an out-of-memory probe left memory in use, and the search goes on in a fresh run."""
    prober = prober or Prober(
        search.spec.experiment, rank, world_size, device, attempt, source=search.spec.model_source()
    )
    prober.first_guess = None

    def probe(spec: TrialSpec) -> list[dict[str, Any]]:
        result = prober.probe(spec)
        result["search"] = search.name
        on_probe(result)  # first: the out-of-memory probe's row is kept
        ranks = _all_ranks(result, world_size)
        if any(r["probe_status"] == "oom" and r["left_bytes"] > LEAK_TOLERANCE_BYTES for r in ranks):
            raise _Leaked
        return ranks

    try:
        if search.needs_calibration():
            rows = [_row_like(probe(spec), spec) for spec in calibration_probes(search)]
            search = dataclasses.replace(
                search, calibration=calibration.per_sample_bytes(rows, device.type == "cuda")
            )
        found = search.search()
        prober.first_guess = found.first_guess
        while (value := found.next_probe()) is not None:
            ranks = probe(search.at(value))
            status = "oom" if any(r["probe_status"] == "oom" for r in ranks) else "ok"
            rises = [r.get("micro_batch_rise_bytes") or r.get("saved_for_backward_bytes") for r in ranks]
            rise = max((x for x in rises if x), default=None)
            found.record(
                value,
                status,
                max(r["peak_allocated_gib"] for r in ranks) if status == "ok" else None,
                rise / GIB / value if rise else None,  # per sample, or per token
            )
        if found.answer is not None and search.timed is not None:
            probe(search.at(found.answer, search.timed, label="timed"))
    except _Leaked:
        return "leak"
    return "done"


def _all_ranks(result: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Every rank's figures of this probe, in rank order (what the search decides on)."""
    mine = {
        k: result.get(k)
        for k in (
            "probe_status",
            "peak_allocated_gib",
            "micro_batch_rise_bytes",
            "saved_for_backward_bytes",
            "left_bytes",
        )
    }
    if world_size == 1:
        return [mine]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def _row_like(ranks: list[dict[str, Any]], spec: TrialSpec) -> dict[str, Any]:
    """A calibration probe's figures as calibration.per_sample_bytes reads them from rows."""

    def largest(key: str) -> Optional[float]:
        values = [r.get(key) for r in ranks if r.get(key) is not None]
        return max(values) if values else None

    return {
        "status": "ok" if all(r["probe_status"] == "ok" for r in ranks) else "oom",
        "backend": spec.point.backend,
        "activation_checkpointing": spec.point.activation_checkpointing,
        "micro_batch_size": spec.point.micro_batch_size,
        "micro_batch_rise_bytes_per_rank_max": largest("micro_batch_rise_bytes"),
        "saved_for_backward_bytes_per_rank_max": largest("saved_for_backward_bytes"),
    }
