"""The cyclic garbage collector's work in a process, for benchmarks: on `BENCH_GC_PROBE=DIR` (set by
`bench._harness.worker_env`, which puts this directory on the workers' PYTHONPATH), every process
started with it records each collection's generation and duration (`gc.callbacks`) and writes them
to DIR/gc-<pid>.json when it exits. `python -m bench.gcprobe DIR` sums them up."""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from typing import Any

_DIR = os.environ.get("BENCH_GC_PROBE")
_started = 0.0
_collections: list[tuple[float, int, float]] = []  # (seconds since start, generation, seconds)
_T0 = time.perf_counter()


def _callback(phase: str, info: dict[str, Any]) -> None:
    global _started
    now = time.perf_counter()
    if phase == "start":
        _started = now
    else:
        _collections.append((round(now - _T0, 3), int(info["generation"]), now - _started))


def _write() -> None:
    record = {
        "argv": sys.argv,
        "cpu_s": time.process_time(),
        "thresholds": gc.get_threshold(),
        "collections": _collections,
    }
    with open(os.path.join(str(_DIR), f"gc-{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


if _DIR:
    gc.callbacks.append(_callback)
    atexit.register(_write)
