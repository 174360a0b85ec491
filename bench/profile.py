"""The top self-time entries of cProfile stats files (`BENCH_PROFILE=DIR python -m bench.throughput`
writes one per worker process), as a Markdown table: CPU ms of the function's own code per job.

    python -m bench.profile [--top 15] [--jobs N] FILE.prof [FILE.prof ...]

Several files are added up (the worker processes of one run). `--jobs`: the jobs they ran (the
`job.start` lines), to give each entry per job; without it, total ms.
"""

from __future__ import annotations

import argparse
import pstats

from bench._harness import REPO

REPO_PREFIX = f"{REPO}/"


def table(files: list[str], top: int, jobs: int | None) -> str:
    stats = pstats.Stats(files[0])
    for f in files[1:]:
        stats.add(f)
    # pstats' table: (file, line, name) -> (primitive calls, calls, self time, cumulative time, callers)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    per = f"self ms per job (of {jobs} jobs)" if jobs else "self ms"
    out = [f"| # | function | calls | {per} | share of self time |", "| ---: | --- | ---: | ---: | ---: |"]
    div = jobs or 1
    for i, ((path, line, name), (_, calls, self_s, _, _)) in enumerate(rows[:top], 1):
        where = f"{path.rsplit('site-packages/', 1)[-1].removeprefix(REPO_PREFIX)}:{line}" if line else path
        out.append(f"| {i} | `{name}` ({where}) | {calls} | {self_s * 1000 / div:.3f} | {self_s / total:.1%} |")
    out.append(f"| | all functions | | {total * 1000 / div:.3f} | 100% |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    print(table(args.files, args.top, args.jobs))


if __name__ == "__main__":
    main()
