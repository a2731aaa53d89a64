"""Ray Train's torch backend behind a config that imports torch only in the processes that use it.

`TorchTrainer` and its `TorchConfig` import torch wherever they are built or unpickled: in Tune's trial
driver and in Ray Train's controller, which train nothing and start one after the other before any
worker can (3-4 s of imports each on the H200; bench/README.md, cut 7). `LazyTorchConfig` sets up the
very same backend, Ray Train's own `_TorchBackend` (process group, MASTER_ADDR, each rank's CUDA
device), imported where it runs: the controller (by default in Tune's trial driver, cut 10) starts that
import in a thread as it starts (`ImportTorchBackendEarly`), while its workers are created and import
torch themselves.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Optional

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
        # The workers import torch to make their process group. Start that now: this process may still
        # be importing it (ImportTorchBackendEarly), and the workers need not wait for that to begin theirs.
        worker_group.execute_async(importlib.import_module, "torch")
        backend, config = self._ray_backend(backend_config)
        backend.on_start(worker_group, config)

    def on_training_start(self, worker_group, backend_config: LazyTorchConfig) -> None:
        backend, config = self._ray_backend(backend_config)
        backend.on_training_start(worker_group, config)

    def on_shutdown(self, worker_group, backend_config: LazyTorchConfig) -> None:
        backend, config = self._ray_backend(backend_config)
        backend.on_shutdown(worker_group, config)


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
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}


class ImportTorchBackendEarly(ControllerCallback):
    """Runs on the Train controller: imports Ray Train's torch backend (and torch) in a thread as the
    controller starts, so that it is ready when the workers are, instead of starting then."""

    def after_controller_start(self, train_run_context) -> None:
        threading.Thread(target=importlib.import_module, args=(_RAY_TORCH_CONFIG,), daemon=True,
                         name="ray_zero-import-torch").start()
