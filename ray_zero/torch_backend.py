"""Ray Train's torch backend behind a config that imports torch only in the processes that use it.

`TorchTrainer` and its `TorchConfig` import torch wherever they are built or unpickled: in Tune's trial
driver and in Ray Train's controller, which train nothing and start one after the other before any
worker can (3-4 s of imports each on the H200; bench/README.md, cut 7). `LazyTorchConfig` sets up the
very same backend, Ray Train's own `_TorchBackend` (process group, MASTER_ADDR, each rank's CUDA
device), imported where it runs: the controller starts that import in a thread as it starts
(`ImportTorchBackendEarly`), while its workers are created and import torch themselves.

With NCCL it binds each rank's process group to the rank's GPU (`bind_to_device`), which Ray Train's
backend does not: bench/README.md has what that changes.
"""
from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import ray
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.util import TrainingFramework

_RAY_TORCH_CONFIG = "ray.train.torch.config"  # Ray Train's torch backend; imports torch


class _LazyTorchBackend(Backend):
    """Ray Train's torch backend, imported at its first use."""

    share_cuda_visible_devices = True  # as Ray Train's: ranks on a node see each other's GPUs (NCCL P2P)

    def __init__(self):
        # Built in the controller at first use, never pickled (the driver only constructs this).
        self._ray: Optional[tuple[Backend, BackendConfig]] = None

    def _ray_backend(self, config: LazyTorchConfig) -> tuple[Backend, BackendConfig]:
        if self._ray is None:
            ray_torch = importlib.import_module(_RAY_TORCH_CONFIG)
            self._ray = ray_torch._TorchBackend(), ray_torch.TorchConfig(
                backend=config.backend, init_method=config.init_method, timeout_s=config.timeout_s)
        return self._ray

    def on_start(self, worker_group, backend_config: LazyTorchConfig) -> None:
        backend, config = self._ray_backend(backend_config)
        if not (backend_config.bind_to_device and backend_config.backend == "nccl"
                and backend_config.init_method == "env"):
            backend.on_start(worker_group, config)
            return
        # Ray Train's on_start (env:// rendezvous, torchrun's variables), each rank's group on its GPU.
        ray_torch = importlib.import_module(_RAY_TORCH_CONFIG)
        address, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, address=address, port=port)
        worker_group.execute(ray_torch._set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(rank, _init_process_group_on_device, world_rank=rank,
                                                   world_size=len(worker_group), timeout_s=backend_config.timeout_s)
                 for rank in range(len(worker_group))])

    def on_training_start(self, worker_group, backend_config: LazyTorchConfig) -> None:
        backend, config = self._ray_backend(backend_config)
        backend.on_training_start(worker_group, config)

    def on_shutdown(self, worker_group, backend_config: LazyTorchConfig) -> None:
        backend, config = self._ray_backend(backend_config)
        backend.on_shutdown(worker_group, config)


def _set_master(address: str, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)


def _init_process_group_on_device(world_rank: int, world_size: int, timeout_s: int) -> None:
    """On a worker: the NCCL process group bound to this rank's GPU (`device_id`). Its communicator is
    made here rather than at the first collective, and the groups DeepSpeed makes from it are split off it
    (ncclCommSplit) instead of each being set up from scratch through the rendezvous store."""
    import torch
    import torch.distributed as dist
    from ray.train.torch import get_device

    # As Ray Train: a timed-out collective fails the rank, unless the user chose otherwise.
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    device = get_device()
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method="env://", rank=world_rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device)


class _SetCudaDevice:
    """Ray Train's `TorchConfigContextManager` around the training function, imported on the worker."""

    def __enter__(self) -> Any:
        self._context = importlib.import_module(_RAY_TORCH_CONFIG).TorchConfigContextManager()
        return self._context.__enter__()

    def __exit__(self, *exc_info) -> bool:
        return self._context.__exit__(*exc_info)


@dataclass
class LazyTorchConfig(BackendConfig):
    """`ray.train.torch.TorchConfig`'s fields and behaviour, without importing torch where it is built."""

    backend: Optional[str] = None
    """nccl, gloo...; None: nccl with GPUs, else gloo (as TorchConfig)."""
    init_method: str = "env"
    timeout_s: int = 1800
    bind_to_device: bool = True
    """NCCL only: the process group bound to each rank's GPU (`device_id`), as torchrun scripts make it;
    False: Ray Train's set-up, whose communicators are made at the first collective."""

    @property
    def backend_cls(self) -> type[Backend]:
        return _LazyTorchBackend

    @property
    def train_func_context(self) -> type:
        return _SetCudaDevice

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s,
                "bind_to_device": self.bind_to_device}


class ImportTorchBackendEarly(ControllerCallback):
    """Runs on the Train controller: imports Ray Train's torch backend (and torch) in a thread as the
    controller starts, so that it is ready when the workers are, instead of starting then."""

    def after_controller_start(self, train_run_context) -> None:
        threading.Thread(target=importlib.import_module, args=(_RAY_TORCH_CONFIG,), daemon=True,
                         name="ray_zero-import-torch").start()
