"""Summary of `BENCH_GC_PROBE` records (see sitecustomize.py here):

    python -m bench.gcprobe DIR [--after SECONDS]

Per worker process: its CPU seconds, and per generation the collections, their total and longest
duration; `--after`: only collections that started that long after the process (skips start-up)."""
