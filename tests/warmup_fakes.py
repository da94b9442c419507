"""Stand-ins for the tune command's warm-up that real worker processes run (tests/test_tuning_warmup.py):
module-level, so that they pickle by name, and recording each step as one line appended to a file, so that a
test reads in what order the workers and the main process did what."""

from __future__ import annotations

import os
import time

FAIL_M = 2  # the warm-up of a key of this M raises
CRASH_M = 16  # ... kills its worker
HANG_M = 99  # ... never ends


def record(log: str, *fields: object) -> None:
    """Append one line (one write to a file opened for appending: lines of processes do not mix)."""
    with open(log, "a") as f:
        f.write(" ".join(map(str, fields)) + "\n")


def record_warm(key, *, log: str) -> None:
    """A warm-up of ``key`` that takes a moment, or fails as its M says."""
    record(log, "warm-start", key.m, os.getpid())
    if key.m == FAIL_M:
        record(log, "warm-fail", key.m, os.getpid())
        raise RuntimeError(f"cannot build the problem of M={key.m}")
    if key.m == CRASH_M:
        record(log, "warm-crash", key.m, os.getpid())
        os._exit(3)
    time.sleep(60 if key.m == HANG_M else 0.3)  # long enough to overlap a timing, were the pool not waited for
    record(log, "warm-end", key.m, os.getpid())
