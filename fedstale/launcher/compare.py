"""`fedstale compare RUN...`: several runs on one plot and in one table.

    fedstale compare runs/fedbuff-* runs/fedpsa-* [--last 5] [--target 0.8] [--out DIR]

A RUN is a run folder, a glob, or a run name under the runs folder (`runs-dir`, else
$FEDSTALE_RUNS_DIR, else ./runs). Runs whose configs differ only in the seed form one group:
the plot shows their mean accuracy with a band (min to max over the seeds) against virtual
time, beside the staleness histogram of each group and, where updates.jsonl records it, the
mean weight the strategy gave per version. The markdown table has one row per group (mean and
std over seeds): final, best, mean of the last k evaluations, AULC, time to target, updates,
rejections. bench/'s paper reproductions build their tables and plots from the same pieces.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fedstale.launcher.analysis import (
    CompareError,
    Run,
    common_metric,
    find_runs,
    group_runs,
    table,
)
from fedstale.launcher.plots import plot
from fedstale.server_app.results import runs_root


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedstale compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders, globs or run names")
    parser.add_argument("--last", type=int, default=5, help="evaluations in the 'last k' mean")
    parser.add_argument("--target", type=float, default=None, help="score for time-to-target")
    parser.add_argument("--out", type=Path, default=None, help="where compare.png/.md go")
    parser.add_argument("--runs-dir", default="", help="where run names are looked up")
    args = parser.parse_args(argv)
    if args.last < 1:
        parser.error("--last must be at least 1")
    root = runs_root(args.runs_dir)
    try:
        folders = find_runs(args.runs, root)
        runs = [Run.load(folder) for folder in folders]
        metric = common_metric(runs)
    except (CompareError, OSError, json.JSONDecodeError, KeyError) as err:
        print(f"fedstale compare: {err}", file=sys.stderr)
        return 2
    if metric == "accuracy" and args.target is not None and not 0.0 <= args.target <= 1.0:
        parser.error(f"--target {args.target:g} is not an accuracy; give one in [0, 1]")
    groups = group_runs(runs)
    out = args.out or root / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    markdown = table(groups, args.last, args.target)
    (out / "compare.md").write_text(markdown + "\n")
    plot(groups, out / "compare.png")
    print(markdown)
    print(
        f"fedstale compare: {len(runs)} runs in {len(groups)} groups; {out / 'compare.png'}",
        file=sys.stderr,
    )
    return 0
