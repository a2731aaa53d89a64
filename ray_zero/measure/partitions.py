"""How each engine deals a model's parameters out to N ranks, tensor by tensor: the elements of
parameters, of gradients and of optimizer states (master copy, Adam's moments) that its fullest rank
holds. Pure arithmetic on the parameters' shapes (ray_zero.models.ModelInfo), read from the engines'
code and checked tensor by tensor on 2 CPU ranks (tests/test_zoo.py):

* DeepSpeed ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py, 0.19.8): the trainable parameters,
  flattened in the module's order into one buffer padded to a multiple of 2N elements, split into N
  equal partitions. A rank steps its partition, but its gradient buffer (`grads_in_partition`) holds
  every tensor that overlaps the partition, whole: a large embedding across a boundary is held twice;
  the last rank's gradients also hold the padding.
* DeepSpeed ZeRO-3: each tensor split N ways (ceil(numel / N) elements per rank). Parameters of at
  most `stage3_param_persistence_threshold` elements (1e5 by default; ray_zero's config leaves it) are
  also kept whole on every rank, beside their partition (at N > 1: at one rank the two are one).
* ZeroRedundancyOptimizer (torch_zero stage 1): whole tensors, largest first, each to the rank with the
  fewest elements so far.
* FSDP2: each tensor's first dimension split N ways, ceil(rows / N) rows per rank, padded.
* DeepSpeed stage 0, DDP: everything on every rank.
Frozen parameters are held (and cast, and partitioned) like the others, with no gradient and no states:
DeepSpeed's optimizers own only what `is_optimized_parameter` (runtime/utils.py: requires_grad) keeps,
while its engine casts, and ZeRO-3 partitions, every module parameter; FSDP2 shards each parameter with
its requires_grad; DDP's reducer and ZeroRedundancyOptimizer take those that require grad (LoRA and
frozen layers to the byte on 2 CPU ranks: tests/test_finetune.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ray_zero.config import registered

DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's stage3_param_persistence_threshold default: parameters this small stay whole on every rank."""
DEEPSPEED_ALIGNMENT = 2
"""ZeRO-1/2's nccl_start_alignment_factor: its flat buffer is padded to a multiple of this times N."""
DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
"""ZeRO-3's sub_group_size default (ray_zero's config leaves it): its step handles one sub-group at a time."""

Shape = Sequence[int]


@dataclass(frozen=True)
class Held:
    """Elements the fullest rank holds, each kind on its own fullest rank (as the rows take the maximum
    over ranks of each kind)."""

    params: float
    gradients: float
    states: float
    """Elements whose master copy and optimizer states the rank keeps (the partition it steps)."""
    trainable: float
    """Parameters that train (all ranks): the replicated engines' gradients and states."""
    step_group: float | None = None
    """Elements of the largest group the optimizer steps at once, where an engine steps its partition in
    groups (ZeRO-3's sub-groups); None: the whole partition (`states`)."""

    @property
    def stepped_at_once(self) -> float:
        return self.states if self.step_group is None else self.step_group


def even(params: float, backend: str, stage: int, num_workers: int, trainable: float | None = None) -> Held:
    """The split when the shapes are unknown: every partition an even 1/N, nothing kept whole."""
    n, t = num_workers, params if trainable is None else trainable
    sharded = _rule(backend).sharded(stage)
    states = t / n if "states" in sharded else t
    return Held(
        params=params / n if "params" in sharded else params,
        gradients=t / n if "gradients" in sharded else t,
        states=states,
        trainable=t,
        step_group=min(states, DEEPSPEED_SUB_GROUP_SIZE) if (backend, stage) == ("deepspeed", 3) else None,
    )


def held(
    trainable_shapes: Sequence[Shape],
    frozen_shapes: Sequence[Shape],
    backend: str,
    stage: int,
    num_workers: int,
    unreached: Sequence[int] = (),
) -> Held:
    """The elements each engine's fullest rank holds for parameters of these shapes (module order);
    `unreached`: indices of the trainable ones the loss does not reach (ModelInfo.unreached_params)."""
    return _rule(backend).held(trainable_shapes, frozen_shapes, stage, num_workers, frozenset(unreached))


@dataclass(frozen=True)
class _Rule:
    """How one engine deals its parameters out: what it shards at a stage, and what its fullest rank holds."""

    sharded: Callable[[int], frozenset[str]]
    """Stage -> which of params, gradients, states it splits N ways."""
    held: Callable[[Sequence[Shape], Sequence[Shape], int, int, frozenset[int]], Held]


def _replicated(trainable_shapes, frozen_shapes) -> Held:
    t = sum(math.prod(s) for s in trainable_shapes)
    return Held(params=t + sum(math.prod(s) for s in frozen_shapes), gradients=t, states=t, trainable=t)


def _deepspeed(trainable_shapes, frozen_shapes, stage: int, n: int, unreached=frozenset()) -> Held:
    trainable = [math.prod(s) for s in trainable_shapes]
    every = trainable + [math.prod(s) for s in frozen_shapes]
    t, p = sum(trainable), sum(every)
    if stage in (1, 2):
        partition, gradients = zero12_partitions(trainable, n, unreached)
        return Held(params=partition * n + p - t, gradients=gradients, states=partition, trainable=t)
    if stage == 3:
        split = [math.ceil(s / n) for s in trainable]
        # At one rank the partition is the whole tensor, one storage: nothing besides it.
        whole = sum(s for s in every if s <= DEEPSPEED_PERSISTENCE_THRESHOLD) if n > 1 else 0
        return Held(
            params=sum(math.ceil(s / n) for s in every) + whole,
            gradients=sum(split),
            states=sum(split),
            trainable=t,
            step_group=max(zero3_sub_groups(split), default=0),
        )
    return _replicated(trainable_shapes, frozen_shapes)


def _torch_zero(trainable_shapes, frozen_shapes, stage: int, n: int, unreached=frozenset()) -> Held:
    # DDP (finding the unused parameters) leaves a parameter the loss does not reach without a gradient,
    # and torch's Adam gives it no states.
    replicated = _replicated(trainable_shapes, frozen_shapes)
    sizes = [math.prod(s) for s in trainable_shapes]
    reached = [0 if i in unreached else size for i, size in enumerate(sizes)]
    states = _greedy_largest(sizes, n, reached) if stage == 1 else sum(reached)
    return Held(replicated.params, sum(reached), states, replicated.trainable)


def _fsdp(trainable_shapes, frozen_shapes, stage: int, n: int, unreached=frozenset()) -> Held:
    rows = _fsdp_rows(trainable_shapes, n)
    # A parameter the loss does not reach gets no gradient, and torch's Adam no states for it.
    reached = _fsdp_rows([s for i, s in enumerate(trainable_shapes) if i not in unreached], n)
    t = sum(math.prod(s) for s in trainable_shapes)
    return Held(params=rows + _fsdp_rows(frozen_shapes, n), gradients=reached, states=reached, trainable=t)


ALL, NONE = frozenset({"params", "gradients", "states"}), frozenset()
PARTITION_RULES = registered(
    {
        "deepspeed": _Rule(
            lambda stage: NONE if stage == 0 else ALL if stage == 3 else frozenset({"gradients", "states"}),
            _deepspeed,
        ),
        "torch_zero": _Rule(lambda stage: frozenset({"states"}) if stage == 1 else NONE, _torch_zero),
        "fsdp": _Rule(lambda stage: ALL, _fsdp),
    },
    "partition rules (ray_zero/measure/partitions.py)",
)


def _rule(backend: str) -> _Rule:
    if backend not in PARTITION_RULES:  # never another engine's split
        raise ValueError(f"no partition rule for backend {backend!r}; allowed: {', '.join(PARTITION_RULES)}")
    return PARTITION_RULES[backend]


def zero12_partitions(sizes: list[int], n: int, unreached=frozenset()) -> tuple[int, int]:
    """ZeRO-1/2's partition size, and the most gradient elements one rank holds: the whole tensors
    overlapping its partition, and on the last rank the zeros that pad the flat buffer to 2N elements
    (get_flat_partition appends them to its gradients: a model of an odd number of parameters, timm's
    RexNet, holds one more element at one rank). A tensor the loss does not reach (`unreached`) is
    counted twice: its place in the buffer, and the zeros get_all_grad_tensors makes for it."""
    alignment = DEEPSPEED_ALIGNMENT * n
    partition = math.ceil(sum(sizes) / alignment) * alignment // n
    padding = partition * n - sum(sizes)
    most = 0
    for rank in range(n):
        low, high, start = rank * partition, (rank + 1) * partition, 0
        overlapping = padding if rank == n - 1 else 0
        for index, size in enumerate(sizes):  # get_partition_info: starts inside, or straddles the start
            if low <= start < high or start < low < start + size:
                overlapping += size * (2 if index in unreached else 1)
            start += size
        most = max(most, overlapping)
    return partition, most


def zero3_sub_groups(partitions: list[int], size: int = DEEPSPEED_SUB_GROUP_SIZE) -> list[int]:
    """ZeRO-3's sub-groups (stage3.py's _create_fp16_sub_groups), in elements of this rank's partitions:
    tensors in order, a group closed once it holds at least `size` (so it can pass `size` by one tensor)."""
    if sum(partitions) <= size:
        return [sum(partitions)]
    groups, current = [], 0
    for elements in partitions:
        current += elements
        if current >= size:
            groups.append(current)
            current = 0
    return groups + ([current] if current else [])


def _greedy_largest(sizes: list[int], n: int, counted: Sequence[int] | None = None) -> int:
    """ZeroRedundancyOptimizer._partition_parameters: largest first, to the least-loaded rank (the first
    such on a tie); the most elements a rank gets, of `counted` (each tensor's, default its size)."""
    counted = sizes if counted is None else counted
    loads, held_counts = [0] * n, [0] * n
    for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = loads.index(min(loads))
        loads[rank] += sizes[index]
        held_counts[rank] += counted[index]
    return max(held_counts)


def _fsdp_rows(shapes: Sequence[Shape], n: int) -> int:
    """FSDP2 shards dim 0: the first rank holds ceil(rows / N) rows of every tensor (a 0-d tensor whole)."""
    return sum(math.ceil(shape[0] / n) * math.prod(shape[1:]) if shape else 1 for shape in shapes)
