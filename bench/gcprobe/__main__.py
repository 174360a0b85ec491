"""`python -m bench.gcprobe DIR [--after SECONDS]`: the summary of `BENCH_GC_PROBE` records."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def summary(directory: Path, after: float = 0.0) -> str:
    lines = [
        "| process | CPU s | thresholds | gen 0: n, ms, max ms | gen 1 | gen 2 | all collections ms |",
        "| --- | ---: | --- | --- | --- | --- | ---: |",
    ]
    for path in sorted(directory.glob("gc-*.json")):
        record = json.loads(path.read_text())
        argv = " ".join(record["argv"][1:]) or record["argv"][0]
        cells, total = [], 0.0
        for gen in range(3):
            ms = [d * 1000 for t, g, d in record["collections"] if g == gen and t >= after]
            total += sum(ms)
            cells.append(f"{len(ms)}, {sum(ms):.0f}, {max(ms, default=0):.1f}")
        thresholds = tuple(record["thresholds"])
        lines.append(f"| {argv} | {record['cpu_s']:.2f} | {thresholds} | {' | '.join(cells)} | {total:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--after", type=float, default=0.0, help="skip collections in the first SECONDS")
    args = parser.parse_args()
    print(summary(args.directory, args.after))


if __name__ == "__main__":
    main()
