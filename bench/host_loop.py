"""Is a host-bound training loop slower inside a Ray actor, or in a second thread as Ray Train runs it?

    python bench/host_loop.py --runs 4 --steps 6000

A small MLP (8 x Linear(64, 64) + GELU, batch 2, AdamW, one torch thread): its step is Python and
dispatch, like the seed model's on a GPU. Ray, Ray Train, Ray Tune and DeepSpeed are imported in every
case, so that only where the loop runs differs: a plain process's main thread, a second thread of it,
a Ray actor's main thread, a thread of that actor that the task waits for, and, as Ray Train runs a
training function, a thread of a task that returned (the actor's main thread back in Ray's task loop),
free or held (ray_zero/main_thread.py). Prints each run's ms per step and how often per step the loop's
thread blocked, then the medians.
`--device cuda` runs the same loop on the GPU (the host launching kernels, as the seed model's step
does there), and ms of the loop thread's CPU time per step beside it.
`--cuda-check runtime` shows what DeepSpeed's NVML-based CUDA check costs such a step on a machine
without a GPU (the Ray actor inherits the setting through the environment Ray gives its workers).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path


def loop_ms_per_step(steps: int, device: str = "cpu") -> tuple[float, float, float]:
    """ms per step, how often per step the loop's thread blocked (on the GIL; on a GPU also on the
    device), and ms of the thread's CPU time per step: ray_zero's own step timer's figures."""
    import torch

    from ray_zero.metrics import StepTimer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(8)])
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 64, device=device)
    timer = StepTimer(torch.device(device))
    for step in range(200 + steps):  # 200 warm-up steps
        if step == 200:
            timer.start()
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    elapsed_s = timer.stop()
    blocks = timer.voluntary_switches / steps if timer.voluntary_switches is not None else float("nan")
    return 1000 * elapsed_s / steps, blocks, 1000 * timer.thread_cpu_s / steps


def in_thread(steps: int, device: str = "cpu") -> tuple[float, float, float]:
    out: list[tuple[float, float, float]] = []
    thread = threading.Thread(target=lambda: out.append(loop_ms_per_step(steps, device)))
    thread.start()
    thread.join()
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--cuda-check", choices=("nvml", "runtime"), default="nvml",
                        help="how torch.cuda.is_available() answers: nvml is what `import deepspeed` sets "
                             "(PYTORCH_NVML_BASED_CUDA_CHECK=1, torch's optimizers ask it every step); runtime "
                             "sets it to 0 first")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.cuda_check == "runtime":
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "0"  # DeepSpeed only sets it where it is unset
    import deepspeed  # noqa: F401  (as a ray_zero worker has it)
    import ray
    import ray.train  # noqa: F401
    import ray.train.torch  # noqa: F401
    import ray.tune  # noqa: F401

    gpus = 1 if args.device == "cuda" else 0
    ray.init(num_cpus=1, num_gpus=gpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    @ray.remote(num_cpus=1, num_gpus=gpus)
    class Looper:
        def __init__(self):
            self.out: list[tuple[float, float, float]] = []
            self.thread: threading.Thread | None = None

        def run(self, threaded: bool, steps: int, device: str) -> tuple[float, float, float]:
            import deepspeed  # noqa: F401
            import ray.train.torch  # noqa: F401
            import ray.tune  # noqa: F401
            from host_loop import in_thread, loop_ms_per_step
            return in_thread(steps, device) if threaded else loop_ms_per_step(steps, device)

        def start(self, steps: int, hold: bool, device: str) -> None:
            """As Ray Train runs a training function: in a thread this task starts, then returns, so that
            the actor's main thread goes back to Ray's task loop while the loop runs."""
            from host_loop import loop_ms_per_step

            from ray_zero.main_thread import HoldMainThread

            def target():
                with HoldMainThread() if hold else contextlib.nullcontext():
                    self.out.append(loop_ms_per_step(steps, device))

            self.out = []
            self.thread = threading.Thread(target=target)
            self.thread.start()

        def poll(self):
            return self.out[0] if self.out else None

    def started_by_a_task(hold: bool) -> tuple[float, float, float]:
        ray.get(looper.start.remote(args.steps, hold, args.device))
        while (result := ray.get(looper.poll.remote())) is None:
            time.sleep(0.25)  # ray_zero's poll interval for Ray Train's controller
        return result

    looper = Looper.remote()
    ways = {"plain process, main thread": lambda: loop_ms_per_step(args.steps, args.device),
            "plain process, second thread": lambda: in_thread(args.steps, args.device),
            "Ray actor, main thread": lambda: ray.get(looper.run.remote(False, args.steps, args.device)),
            "Ray actor, second thread": lambda: ray.get(looper.run.remote(True, args.steps, args.device)),
            "Ray actor, thread of a task that returned": lambda: started_by_a_task(False),
            "the same, main thread held": lambda: started_by_a_task(True)}
    times: dict[str, list[float]] = {way: [] for way in ways}
    blocks: dict[str, list[float]] = {way: [] for way in ways}
    cpu: dict[str, list[float]] = {way: [] for way in ways}
    for run in range(args.runs):  # the ways alternate, so that a drift of the machine hits all alike
        for way, measure in ways.items():
            ms, blocked, cpu_ms = measure()
            times[way].append(ms)
            blocks[way].append(blocked)
            cpu[way].append(cpu_ms)
            print(f"run {run + 1}, {way}: {ms:.3f} ms/step, blocked {blocked:.3f} times a step, "
                  f"CPU {cpu_ms:.3f} ms/step", flush=True)
    for way, values in times.items():
        print(f"median, {way}: {statistics.median(values):.3f} ms/step, "
              f"blocked {statistics.median(blocks[way]):.3f} times a step, CPU {statistics.median(cpu[way]):.3f} ms/step")
    ray.shutdown()


if __name__ == "__main__":
    main()
