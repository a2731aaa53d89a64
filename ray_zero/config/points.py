"""The engines (registered once, here), which ZeRO stages each runs, and a grid's Point: one trial's
engine, stage, micro-batch size, workers, checkpointing, offload and (on a seq_len axis) sequence length."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, TypeVar


@dataclass(frozen=True)
class EngineEntry:
    """A registered engine: its name (the `backend` of a grid), its stages and what it is."""

    name: str
    stages: tuple[int, ...]
    offload_stages: tuple[int, ...]
    """Stages at which it can keep the optimizer in CPU memory (offload_optimizer: cpu)."""
    description: str


ENGINES = {
    e.name: e
    for e in (
        EngineEntry("deepspeed", (0, 1, 2, 3), (1, 2, 3), "DeepSpeed ZeRO (deepspeed.initialize)"),
        EngineEntry("torch_zero", (0, 1), (), "PyTorch DDP (0), + ZeroRedundancyOptimizer (1)"),
        EngineEntry("fsdp", (2, 3), (), "FSDP2 fully_shard: gradients sharded (2), parameters too (3)"),
    )
}
"""Every engine, once. Its class (ray_zero/train/engines.py), memory model (measure/engine_memory.py) and
partition rule (measure/partitions.py) are looked up by its name in one table each, and each table is
checked against this one at import (`registered`): an engine missing a piece fails there."""
BACKEND_STAGES = {name: engine.stages for name, engine in ENGINES.items()}
"""The ZeRO stages each engine has: torch_zero is DDP (stage 0) or DDP + ZeroRedundancyOptimizer (stage 1);
FSDP2 keeps gradients sharded (stage 2, reshard_after_forward=False) and parameters too (stage 3)."""
Stage = Literal[0, 1, 2, 3]
Backend = Literal[tuple(ENGINES)]  # type: ignore[valid-type]
Offload = Literal["none", "cpu"]
OFFLOADS = ("none", "cpu")

_Table = TypeVar("_Table", bound=Mapping)


def registered(table: _Table, what: str) -> _Table:
    """`table`, keyed by exactly the registered engines; else an error naming what is missing or extra."""
    missing, extra = set(ENGINES) - set(table), set(table) - set(ENGINES)
    if missing or extra:
        problem = f"no entry for engines {sorted(missing)}" if missing else f"unknown engines {sorted(extra)}"
        raise RuntimeError(f"{what}: {problem} (config/points.py's ENGINES registers them)")
    return table


def unsupported(backend: str, stage: int, offload_optimizer: str = "none") -> Optional[str]:
    """Why no engine can run this point, in one phrase; None when one can."""
    if backend not in ENGINES:
        return f"backend must be one of {', '.join(ENGINES)}, not {backend!r}"
    engine = ENGINES[backend]
    if offload_optimizer not in OFFLOADS:
        return f"offload_optimizer must be one of {', '.join(OFFLOADS)}, not {offload_optimizer!r}"
    if stage not in engine.stages:
        return f"{backend} has stages {', '.join(map(str, engine.stages))}, not {stage}"
    if offload_optimizer != "none" and stage not in engine.offload_stages:
        offloading = [
            f"{e.name} with stage {_or(e.offload_stages)}" for e in ENGINES.values() if e.offload_stages
        ]
        return f"offload_optimizer needs backend {'; '.join(offloading)}"
    return None


def _or(values: tuple[int, ...]) -> str:
    """1, 2 or 3."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@dataclass(frozen=True)
class Point:
    """One grid point: one trial."""

    backend: str
    stage: int
    micro_batch_size: int
    num_workers: int
    activation_checkpointing: bool = False
    offload_optimizer: str = "none"
    seq_len: Optional[int] = None
    """Tokens per sample where the grid has a seq_len axis (grid.seq_len); None: the experiment's seq_len."""

    @property
    def name(self) -> str:
        """deepspeed points keep the short names of earlier results (stage1_mb64_w2); a seq_len axis adds
        _s512."""
        prefix = "" if self.backend == "deepspeed" else f"{self.backend}_"
        suffix = (
            ("_ac" if self.activation_checkpointing else "")
            + (f"_offload{self.offload_optimizer}" if self.offload_optimizer != "none" else "")
            + (f"_s{self.seq_len}" if self.seq_len is not None else "")
        )
        return f"{prefix}stage{self.stage}_mb{self.micro_batch_size}_w{self.num_workers}{suffix}"

    def replace(self, **changes: Any) -> "Point":
        return dataclasses.replace(self, **changes)

    def fields(self) -> dict[str, Any]:
        """Its fields by name: the one list of a point's fields (rows, engine settings, gauge tags)."""
        return dataclasses.asdict(self)
