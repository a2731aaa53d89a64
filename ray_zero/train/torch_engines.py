"""The torch engines: TorchZeroEngine (DDP + ZeroRedundancyOptimizer, stages 0-1) and FSDPEngine (FSDP2,
stages 2-3), both over fp32 parameters with autocast or FSDP2's mixed precision."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc

import torch
import torch.distributed as dist

from ray_zero.train.ds_config import LOW_PRECISION, batch_norms
from ray_zero.train.engine_base import Engine, optimizer_class, optimizer_kwargs
from ray_zero.train.precision import cast_float_buffers
from ray_zero.train.state_bytes import state_bytes


class _TorchEngine(Engine):
    """What DDP and FSDP2 share: a torch optimizer over fp32 parameters, a grad scaler for fp16."""

    optimizer: torch.optim.Optimizer
    local_optimizer: torch.optim.Optimizer  # the one that holds this rank's states
    scaler = None

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        self.config = settings.as_dict()

    def _backward(self, loss: torch.Tensor, boundary: bool) -> None:
        scaled = loss / self.settings.gradient_accumulation_steps
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()

    def _step(self):
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _state_bytes(self):
        # DDP's gradient buckets (one more copy of all gradients, gradient_as_bucket_view=False) live in its
        # C++ reducer, not reachable through public attributes: they are not counted.
        return state_bytes(self.spec.module, self.local_optimizer)


class TorchZeroEngine(_TorchEngine):
    """DDP with AdamW (stage 0) or ZeroRedundancyOptimizer(AdamW) (stage 1), fp32 parameters, autocast.
    Autocast leaves BatchNorm alone: it normalises low-precision activations with its fp32 weights and
    running statistics (DDP broadcasts those from rank 0 at each forward)."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        from torch.nn.parallel import DistributedDataParallel

        # Stock DDP: its C++ reducer all-reduces the gradient buckets, no comm hook (reducer_bytes counts
        # them).
        self.model = DistributedDataParallel(
            spec.module,
            device_ids=[device] if device.type == "cuda" else None,
            find_unused_parameters=settings.unreached_params,  # else its second step raises
        )
        params = [p for p in spec.module.parameters() if p.requires_grad]
        optimizer_cls, kwargs = optimizer_class(settings.optimizer.type), optimizer_kwargs(settings)
        if settings.stage == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, **kwargs)
            self.local_optimizer = self.optimizer.optim  # over this rank's share of the parameters only
        else:
            self.optimizer = self.local_optimizer = optimizer_cls(params, **kwargs)
        self.autocast_dtype = LOW_PRECISION.get(settings.precision)
        if settings.precision == "fp16":
            self.scaler = torch.amp.GradScaler(device.type)
        self._collected = False

    def reducer_bytes(self):
        # The reducer all-reduces, at each boundary backward, its buckets: flat copies of the gradients of
        # every parameter it reduces (those that train), in their dtype, unpadded. A comm hook would be
        # Python that the timed steps do not run; tests/test_counting.py checks these bytes against
        # torch's own allreduce_hook counted through torch.distributed.
        if dist.get_world_size() == 1:
            return {}
        trained = (p for p in self.model.parameters() if p.requires_grad)
        return {"all_reduce": sum(p.numel() * p.element_size() for p in trained)}

    def _micro_batch(self, boundary):
        # no_sync must hold through backward: that is where DDP's all-reduce runs.
        return contextlib.nullcontext() if boundary else self.model.no_sync()

    def _step(self):
        super()._step()
        if not self._collected:
            # DDP rebuilds its gradient buckets at its second iteration. Unless Python's collector runs
            # first, the old buckets may outlive the new ones' allocation (4 bytes per parameter more),
            # leaving the trial's peak above its steady steps' by chance. The runs: docs/h200-results.md
            # (bench/ddp_rebuild_probe.py).
            gc.collect()
            self._collected = True

    def _forward(self, batch, boundary):
        if not self.autocast_dtype:
            return self.spec.loss(self.model, batch)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return self.spec.loss(self.model, batch)


class FSDPEngine(_TorchEngine):
    """FSDP2: fully_shard on each block, then the root; one mesh over all ranks."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # Parameters compute in low precision (FSDP2 casts them, and the root's floating inputs); gradients
        # are reduced and kept in fp32, like the sharded fp32 parameters the optimizer steps.
        low = LOW_PRECISION.get(settings.precision)
        policy = (
            MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
            if low
            else MixedPrecisionPolicy()
        )
        shard = functools.partial(
            fully_shard, mesh=mesh, reshard_after_forward=settings.stage == 3, mp_policy=policy
        )
        if low:
            # FSDP2 casts parameters, not buffers: a BatchNorm would meet low-precision weights and fp32
            # running statistics. As FSDP1 did by default and FSDP2's authors advise (pytorch/torchtitan#674),
            # each BatchNorm is its own group computing in fp32; BatchNorm kernels take low-precision inputs
            # with fp32 weights and statistics, and return the inputs' dtype.
            for norm in batch_norms(spec.module):
                shard(norm, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        # FSDP2 casts parameters, not buffers: those the module computes with its low-precision weights go
        # with them (BatchNorms' statistics stay fp32, in their fp32 groups), ray_zero/train/precision.py.
        cast_float_buffers(spec.module, settings.precision, keep_norms=True)
        blocks = list(spec.blocks or ())
        # Parameters that several blocks hold (CoaT shares a module between its blocks, Zamba ties its
        # shared transformer's weights) go in one group of their own, sharded first: FSDP2 refuses a
        # parameter that another group manages already.
        holders = collections.Counter(id(q) for block in blocks for q in set(block.parameters()))
        shared = {
            id(m): m
            for block in blocks
            for m in block.modules()
            if any(holders[id(q)] > 1 for q in m.parameters(recurse=False))
        }
        if shared:
            shard(list(shared.values()))
        for block in blocks:
            shard(block)
        self.model = shard(spec.module)
        params = [p for p in spec.module.parameters() if p.requires_grad]
        self.optimizer = self.local_optimizer = optimizer_class(settings.optimizer.type)(
            params, **optimizer_kwargs(settings)
        )
        if settings.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device.type)  # all ranks agree on inf/NaN before skipping a step

    def _forward(self, batch, boundary):
        # Reduce-scatter every micro-batch, as DeepSpeed's ZeRO-2/3 do: skipping it
        # (set_requires_gradient_sync) would keep whole gradients between micro-batches, the memory stages 2
        # and 3 exist to save.
        return self.spec.loss(self.model, batch)
