"""What ray_zero says as it runs: the `ray_zero` logger. The CLI shows its lines on stdout as
`ray_zero: ...` (info and up; --verbose adds debug, --quiet keeps warnings only); a script sees the same
with `ray_zero.log_to_console()`, or routes the logger wherever its own logging goes."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("ray_zero")
log.addHandler(logging.NullHandler())  # a library says nothing until its user asks


class _Stdout(logging.StreamHandler):
    """Writes to whatever sys.stdout is at each line (a test's capture, a notebook's redirection)."""

    _ray_zero_console = True

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def log_to_console(level: int = logging.INFO) -> None:
    """Show ray_zero's lines on stdout, as `ray_zero: MESSAGE`, from `level` up (once: a second call
    changes the level)."""
    if not any(getattr(h, "_ray_zero_console", False) for h in log.handlers):
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("ray_zero: %(message)s"))
        log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False  # not twice where the script's root logger prints too
