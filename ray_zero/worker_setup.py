"""The setup hook Ray Train's worker processes run as they start: import torch in a thread.

A rank imported torch only when Ray Train set up its process group, after its process had started
Python and Ray, become Ray Train's worker and answered the controller's first calls (bench/README.md,
cut 9). The hook starts that import at once, beside all of that. Only torch: DeepSpeed's import asks
CUDA for its devices, which must wait until Ray Train has set the rank's CUDA_VISIBLE_DEVICES.

Standard library only: Ray ships this function to the workers by value (ray_zero.torch_backend), as
a worker runs it before it can import ray_zero (Ray adds the driver's folders to its path later).
"""
import importlib
import os
import threading
import time

# The marks a rank reports: when this process started and finished importing torch here.
STARTED_ENV = "RAY_ZERO_TORCH_IMPORT_STARTED_AT"
FINISHED_ENV = "RAY_ZERO_TORCH_IMPORTED_AT"


def import_torch_in_a_thread() -> None:
    def run() -> None:
        os.environ[STARTED_ENV] = repr(time.time())
        importlib.import_module("torch")
        os.environ[FINISHED_ENV] = repr(time.time())

    threading.Thread(target=run, daemon=True, name="ray_zero-import-torch").start()
