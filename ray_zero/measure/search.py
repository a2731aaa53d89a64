"""The search `fit` runs for one (engine, stage, workers) point: the largest micro-batch whose measured
peak memory per rank stays within a budget. Pure: no Ray, no torch (tests drive it with numbers).

It brackets and then narrows, each probe a real trial: the first probe where the memory model puts the
answer (or the smallest micro-batch when it cannot), the next ones where a straight line through the
measurements crosses the budget (memory grows about linearly with the micro-batch: activations), kept
strictly inside the bracket, and halving the bracket when the line says nothing new.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

from ray_zero.config import ConfigError

TARGETS = {"micro_batch": "micro_batch_size", "seq_len": "seq_len"}
"""What fit searches (--target), and the grid point's field it varies."""


@dataclass(frozen=True)
class FitSettings:
    """What `fit` searches within: the memory budget per rank, the micro-batches it may try."""

    budget_gib: Optional[float] = None
    """Memory per rank to stay within (GPU default: the device's memory less margin_gib; CPU: required)."""
    margin_gib: float = 2.0
    granularity: Optional[int] = None
    """Search to a multiple of this many samples (default: every size below 64, multiples of 8 above), or
    tokens with target seq_len (default 64)."""
    max_micro_batch: int = 65536
    target: Literal["micro_batch", "seq_len"] = "micro_batch"
    """micro_batch: the largest micro-batch (at each seq_len of the grid); seq_len: the longest sequence
    at each micro-batch of the grid."""
    max_seq_len: Optional[int] = None
    """target seq_len: the longest sequence tried (default: the model's maximum positions)."""

    @property
    def field(self) -> str:
        """The point's field the search varies."""
        return TARGETS[self.target]

    def steps(self, sizes: list[int], max_positions: Optional[int]) -> "Steps":
        """The values a search may try: micro-batches up to max_micro_batch (the grid's largest where it
        gives several), or sequence lengths in steps of `granularity` tokens up to the model's positions."""
        if self.target == "seq_len":
            limits = [n for n in (self.max_seq_len, max_positions) if n]
            return Steps(self.granularity or SEQ_LEN_GRANULARITY, min(limits, default=65536))
        largest = min(self.max_micro_batch, max(sizes)) if len(sizes) > 1 else self.max_micro_batch
        return Steps(self.granularity, largest)

    def check_model(self, seq_len: Optional[int], grid_seq_len: Optional[list[int]]) -> None:
        """target seq_len: a token model (one with a seq_len), and no seq_len axis (the search varies it)."""
        if self.target != "seq_len":
            return
        if seq_len is None:
            raise ConfigError("fit --target seq_len needs a token model (one trained on seq_len tokens)")
        if grid_seq_len:
            raise ConfigError(
                f"fit --target seq_len searches the length: give no grid.seq_len ({grid_seq_len}); "
                "--max-seq-len bounds it"
            )

    def check(self, device: str) -> None:
        """Refuse bad settings in one line, before Ray starts (`device`: the experiment's)."""
        if self.target not in TARGETS:
            raise ConfigError(f"--target {self.target}: allowed: {', '.join(TARGETS)}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ConfigError(f"--max-seq-len {self.max_seq_len}: give a whole number of tokens, at least 1")
        if self.budget_gib is not None and self.budget_gib <= 0:
            raise ConfigError(f"--budget-gib {self.budget_gib}: give a positive number of GiB per rank")
        if self.granularity is not None and self.granularity < 1:
            raise ConfigError(f"--granularity {self.granularity}: give a whole number of samples, at least 1")
        if self.budget_gib is None and device == "cpu":
            raise ConfigError(CPU_NEEDS_A_BUDGET)

    def budget(self, use_gpu: bool, gpu_memory_gib: Optional[float]) -> float:
        if self.budget_gib is not None:
            return self.budget_gib
        if not use_gpu:
            raise ConfigError(CPU_NEEDS_A_BUDGET)
        if not gpu_memory_gib:
            raise ConfigError("fit on a cluster whose GPUs are on other nodes needs --budget-gib G")
        return gpu_memory_gib - self.margin_gib


CPU_NEEDS_A_BUDGET = "fit on CPU needs --budget-gib G: the peak resident set per worker to stay within"
SEQ_LEN_GRANULARITY = 64
"""fit --target seq_len searches to a multiple of this many tokens unless --granularity says otherwise."""


@dataclass(frozen=True)
class Steps:
    """The micro-batches a search may try: multiples of `granularity`, or (default) every size below 64
    and multiples of 8 from 64 on."""

    granularity: Optional[int] = None
    largest: int = 65536

    def down(self, value: float) -> int:
        """The largest allowed micro-batch at most `value` (at least the smallest allowed)."""
        value = max(int(math.floor(value)), 1)
        if self.granularity:
            return max(self.granularity, value // self.granularity * self.granularity)
        return value if value < 64 else value // 8 * 8

    def up(self, value: int) -> int:
        """The next allowed micro-batch above `value`."""
        if self.granularity:
            return value + self.granularity
        return value + 1 if value < 64 else value + 8

    @property
    def smallest(self) -> int:
        return self.granularity or 1


def largest_predicted_to_fit(
    predicted: Callable[[int], Optional[float]], budget_gib: float, steps: Steps
) -> Optional[int]:
    """The largest allowed micro-batch whose predicted peak (GiB, None: unknown) is within the budget:
    doubling, then bisection. The smallest allowed when even that is over (a probe then says by how much);
    None when the model cannot predict."""
    smallest = predicted(steps.smallest)
    if smallest is None or smallest > budget_gib:
        return None if smallest is None else steps.smallest
    low, high = steps.smallest, None
    while high is None:  # double until over the budget or at the largest allowed
        larger = min(2 * low, steps.largest)
        if larger <= low:
            return steps.down(low)
        if predicted(larger) <= budget_gib:
            low = larger
        else:
            high = larger
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if predicted(middle) <= budget_gib else (low, middle)
    return steps.down(low)


@dataclass
class Probe:
    micro_batch_size: int
    fits: bool
    peak_gib: Optional[float]
    """The measured peak (None for an out-of-memory probe, whose peak was not reached)."""
    per_sample_gib: Optional[float] = None
    """Memory the probe's micro-batch added per sample (activations), where measured."""


CONFIRM = 0.05
"""A first probe measured within this fraction of its prediction confirms the prediction: the next size
up is probed only where it too is predicted within this fraction of the budget."""


@dataclass
class BracketSearch:
    budget_gib: float
    steps: Steps
    first_guess: Optional[int] = None
    """Where the memory model puts the answer; None: start at the smallest micro-batch."""
    predicted: Optional[Callable[[int], Optional[float]]] = None
    """The memory model's peak (GiB) at a micro-batch, where it predicts one: a first guess it predicted
    well is confirmed rather than searched around."""
    probes: list[Probe] = field(default_factory=list)
    stopped: Optional[str] = None
    """Why the search ended early (a probe failed for another reason than memory)."""

    def record(
        self,
        micro_batch_size: int,
        status: str,
        peak_gib: Optional[float],
        per_sample_gib: Optional[float] = None,
        error: str = "",
    ) -> None:
        if status not in ("ok", "oom"):
            self.stopped = f"micro-batch {micro_batch_size}: {status}: {error}"
            return
        fits = status == "ok" and peak_gib is not None and peak_gib <= self.budget_gib
        self.probes.append(
            Probe(micro_batch_size, fits, peak_gib if status == "ok" else None, per_sample_gib)
        )

    @property
    def lo(self) -> Optional[Probe]:
        fitting = [p for p in self.probes if p.fits]
        return max(fitting, key=lambda p: p.micro_batch_size) if fitting else None

    @property
    def hi(self) -> Optional[Probe]:
        over = [p for p in self.probes if not p.fits]
        return min(over, key=lambda p: p.micro_batch_size) if over else None

    @property
    def answer(self) -> Optional[int]:
        """The largest micro-batch measured to fit (None: none did, or none yet)."""
        return self.lo.micro_batch_size if self.lo else None

    def _slope(self) -> Optional[float]:
        """GiB per sample: through two measured peaks if there are, else what one probe measured."""
        measured = sorted(
            (p for p in self.probes if p.peak_gib is not None), key=lambda p: p.micro_batch_size
        )
        if len(measured) >= 2:
            a, b = measured[-2], measured[-1]
            if b.peak_gib > a.peak_gib:
                return (b.peak_gib - a.peak_gib) / (b.micro_batch_size - a.micro_batch_size)
        slopes = [p.per_sample_gib for p in measured if p.per_sample_gib]
        return slopes[-1] if slopes else None

    def _confirmed(self, lo: Probe) -> Optional[int]:
        """After a first guess that fit and measured as predicted (within CONFIRM): 0 when the next size
        up is predicted over the budget by more than CONFIRM (the guess is the answer), else that size
        (to measure). None: no prediction to confirm, or it missed (search as usual)."""
        if self.predicted is None or len(self.probes) != 1 or lo.micro_batch_size != self.first_guess:
            return None
        here, up = self.predicted(lo.micro_batch_size), self.steps.up(lo.micro_batch_size)
        above = self.predicted(up) if up <= self.steps.largest else None
        if not here or lo.peak_gib is None or abs(lo.peak_gib / here - 1) > CONFIRM or above is None:
            return None
        return 0 if above > self.budget_gib * (1 + CONFIRM) else up

    def next_probe(self) -> Optional[int]:
        """The micro-batch to try next; None when the search is done."""
        if self.stopped:
            return None
        tried = {p.micro_batch_size for p in self.probes}
        lo, hi, steps = self.lo, self.hi, self.steps
        if lo is None and hi is None:
            return steps.down(min(self.first_guess or steps.smallest, steps.largest))
        slope = self._slope()
        if hi is None:  # everything fits so far: reach for the budget, at least one step up
            if lo.micro_batch_size >= steps.largest:
                return None
            confirmed = self._confirmed(lo)
            if confirmed is not None:
                return confirmed or None
            reach = (
                lo.micro_batch_size + (self.budget_gib - lo.peak_gib) / slope
                if slope
                else 2 * lo.micro_batch_size
            )
            guess = steps.down(min(reach, 8 * lo.micro_batch_size, steps.largest))
            guess = max(guess, steps.up(lo.micro_batch_size))
        elif lo is None:  # nothing fits so far: come down
            if hi.micro_batch_size <= steps.smallest:
                return None
            guess = hi.micro_batch_size / 2
            if slope and hi.peak_gib is not None:
                guess = hi.micro_batch_size - (hi.peak_gib - self.budget_gib) / slope
            guess = min(steps.down(guess), steps.down(hi.micro_batch_size - 1))
        else:  # a bracket: where the line crosses the budget, else its middle
            low, high = lo.micro_batch_size, hi.micro_batch_size
            if steps.up(low) >= high:
                return None
            middle = steps.down((low + high) / 2)
            guess = steps.down(low + (self.budget_gib - lo.peak_gib) / slope) if slope else middle
            if guess <= low:  # the line says the answer is here: check the next size up
                guess = steps.up(low)
            if guess >= high:
                guess = steps.down(high - 1)
            if guess <= low or guess in tried:
                guess = middle if low < middle < high else None
        return None if guess is None or guess in tried else guess
