"""Run `python -m taskloom ARGS...` with cProfile (CPU time, not wall time) switched on by SIGUSR1 and
off by SIGUSR2, so that a benchmark profiles its measured window only, not the imports and start-up; the stats are
written to the file named by `BENCH_PROFILE_OUT` when the process exits.

    BENCH_PROFILE_OUT=worker.prof python -m bench._profiled worker executor
"""

from __future__ import annotations

import atexit
import cProfile
import os
import runpy
import signal
import sys
import time


def main() -> None:
    profiler = cProfile.Profile(time.process_time)
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, lambda *_: profiler.disable())  # the measured window ends

    def dump() -> None:
        profiler.disable()
        profiler.dump_stats(os.environ["BENCH_PROFILE_OUT"])

    atexit.register(dump)
    sys.argv = ["taskloom", *sys.argv[1:]]
    runpy.run_module("taskloom", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
