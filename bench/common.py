"""What the benchmarks share: where the checkout is, the versions and machine a run records beside its
figures, a free port, an error in one line, a file written whole. Standard library only: a benchmark's
driver imports it before deciding what to import.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The checkout: ray_zero/, experiments/, docs/."""


def versions(names=("torch", "deepspeed", "ray", "transformers", "timm")) -> dict[str, str]:
    """Python's version and each package's installed one ("not installed" where it is not)."""
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def machine() -> str:
    """This machine in a line: its name, architecture and CPUs, and its GPUs by name (nvidia-smi)."""
    gpus = ""
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        gpus = subprocess.run(query, capture_output=True, text=True).stdout.strip().replace("\n", ", ")
    return f"{platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, {gpus or 'no GPU'}"


def free_port() -> int:
    """A port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(error: BaseException, limit: int = 400) -> str:
    """An exception as its type and the start of its message, on one line."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}" if text else type(error).__name__


def write_whole(path: Path, text: str) -> None:
    """Write `text` beside `path`, then rename it there: a reader never sees half a file."""
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text)
    partial.replace(path)
