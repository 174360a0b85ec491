"""The top self-time entries of cProfile stats files (`BENCH_PROFILE=DIR python -m bench.throughput`
or `bench.speedup` writes one per worker process, CPU time of the measured window), as a Markdown
table: CPU ms in the function's own code per job (or per goal).

    python -m bench.profile [--top 15] [--per N] [--unit job] [--areas] FILE.prof [FILE.prof ...]

Several files are added up (the worker processes of one run). `--per`: the jobs (or goals) they
ran, to give each entry per job; without it, total ms. cProfile's own cost per call inflates
call-heavy code, so read the shares against each other and the /proc CPU of unprofiled runs for
the totals.

    python -m bench.profile --pyspy [--top 15] DIR/*.txt

The same benchmarks under `BENCH_PYSPY=DIR` sample their workers with py-spy instead (no cost per
call); this prints the frames the samples were in, by share.
"""

from __future__ import annotations

import argparse
import pstats
import sysconfig
from collections import Counter
from pathlib import Path

from bench._harness import REPO

PREFIXES = (f"{REPO}/", f"{sysconfig.get_paths()['purelib']}/", f"{sysconfig.get_paths()['stdlib']}/")


def _where(path: str, line: int) -> str:
    if not line:  # a built-in
        return ""
    for prefix in PREFIXES:
        path = path.removeprefix(prefix)
    return f" ({path}:{line})"


def table(files: list[str], top: int, per: int | None, unit: str = "job") -> str:
    stats = pstats.Stats(files[0])
    for f in files[1:]:
        stats.add(f)
    # pstats' table: (file, line, name) -> (primitive calls, calls, self time, cumulative time, callers)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    head = f"self ms per {unit} (of {per} {unit}s)" if per else "self ms"
    out = [f"| # | function | calls | {head} | share of self time |", "| ---: | --- | ---: | ---: | ---: |"]
    div = per or 1
    for i, ((path, line, name), (_, calls, self_s, _, _)) in enumerate(rows[:top], 1):
        share = self_s / total
        out.append(f"| {i} | `{name}`{_where(path, line)} | {calls} | {self_s * 1000 / div:.3f} | {share:.1%} |")
    out.append(f"| | all functions | | {total * 1000 / div:.3f} | 100% |")
    return "\n".join(out)


# Where a frame's own time goes, by the file it is in (first match wins); built-ins (isinstance,
# len, a socket's send) are one area of their own, as cProfile does not say who called them.
AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Anthropic SDK and its HTTP stack", ("anthropic/", "httpx", "httpcore", "h11/", "anyio/", "sniffio")),
    ("redis-py", ("redis/",)),
    ("asyncio and selectors", ("asyncio/", "selectors.py")),
    ("logging (structlog, stdlib)", ("structlog/", "logging/")),
    ("pydantic", ("pydantic",)),
    ("json", ("json/",)),
    ("arq", ("arq/",)),
    ("taskloom's own code", (f"{REPO}/",)),
)


def areas(files: list[str], per: int | None, unit: str = "job") -> str:
    """Self time by area (`AREAS`), per job: what each layer costs, whoever calls it."""
    stats = pstats.Stats(files[0])
    for f in files[1:]:
        stats.add(f)
    totals = dict.fromkeys([name for name, _ in AREAS] + ["built-ins", "other"], 0.0)
    for (path, line, _), (_, _, self_s, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        area = next((name for name, marks in AREAS if any(m in path for m in marks)), None)
        totals[area or ("built-ins" if not line else "other")] += self_s
    total = sum(totals.values())
    div = per or 1
    out = [f"| area | self ms per {unit} | share |", "| --- | ---: | ---: |"]
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]):
        out.append(f"| {name} | {t * 1000 / div:.2f} | {t / total:.0%} |")
    return "\n".join(out)


def sampled(files: list[str], top: int) -> str:
    """The top leaf frames of py-spy's collapsed stacks (`BENCH_PYSPY`): the share of the samples
    each frame was running in, its own code (or the C it called: a socket's send is its caller's).
    Threads that only wait (the tool threads' queue) are left out; py-spy does not tell a thread
    waiting in C from one computing, so they would swell the count without being CPU."""
    leaves: Counter[str] = Counter()
    for name in files:
        for line in Path(name).read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit() or any(idle in stack for idle in IDLE_FRAMES):
                continue
            leaves[stack.rsplit(";", 1)[-1].strip() or "(no Python frame)"] += int(count)
    total = sum(leaves.values())
    out = ["| # | frame | samples | share of samples |", "| ---: | --- | ---: | ---: |"]
    for i, (frame, n) in enumerate(leaves.most_common(top), 1):
        out.append(f"| {i} | `{frame}` | {n} | {n / total:.1%} |")
    out.append(f"| | all samples | {total} | 100% |")
    return "\n".join(out)


# Frames of threads that sit waiting for work (the executor's tool threads, asyncio's executor).
IDLE_FRAMES = ("_DaemonThreads._work", "concurrent/futures/thread.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--per", type=int, default=None, help="jobs (or goals) the profiled processes ran")
    parser.add_argument("--unit", default="job")
    parser.add_argument("--areas", action="store_true", help="self time by area (SDK, redis-py, asyncio, ...)")
    parser.add_argument("--pyspy", action="store_true", help="the files are py-spy's collapsed stacks (BENCH_PYSPY)")
    args = parser.parse_args()
    if args.pyspy:
        print(sampled(args.files, args.top))
    elif args.areas:
        print(areas(args.files, args.per, args.unit))
    else:
        print(table(args.files, args.top, args.per, args.unit))


if __name__ == "__main__":
    main()
