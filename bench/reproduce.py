"""The one reproduction driver: each paper's file (bench/reproduce_<paper>.py) describes its
suites (which runs, which table, which plot), its protocol and its own flags in a `Paper`,
and this module does the rest: the command line, running the grid or reporting what is
done, writing each suite's table and plot, and the closing lines. Also the pieces every
paper's tables and plots share: a run's curve, the time it first reaches a target, the
mean curve over seeds, a figure that saves and closes itself.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bench.grid import Job, Runner, finished, run_all
from fedstale.launcher.analysis import first_reach

Result = dict[str, Any]
Options = argparse.Namespace
Cell = TypeVar("Cell")


@dataclass(frozen=True)
class Suite:
    """One table of a paper: its runs, its markdown (written to `<file>` under the output
    folder) and optionally its plot (`<png>` there; drawn only when some run is done unless
    `plot_empty`)."""

    jobs: Callable[[Options], list[Job]]
    table: Callable[[list[Result], Options], str]
    file: str
    plot: Callable[[list[Result], Path], None] | None = None
    png: str = ""
    plot_empty: bool = False


def announce_runs(suite: str, jobs: list[Job], options: Options) -> str:
    return f"{suite}: {len(jobs)} runs on {options.workers} workers"


def run_hours(results: list[Result]) -> str:
    hours = sum(r["seconds"] for r in results) / 3600
    return f"{len(results)} runs, {hours:.2f} h of run time in all"


def wall_minutes(results: list[Result], out: Path, minutes: float) -> str:
    return f"{minutes:.1f} min wall in this invocation; {out}"


@dataclass(frozen=True)
class Paper:
    """What is particular to one paper. `runner(options)`: the picklable function that runs
    one job in a worker; `out(options)`: the output folder; `announce(suite, jobs, options)`:
    the line before a suite's runs; `tally(results)`: the line after its table (None: none);
    `closing(results, out, wall_minutes)`: the last line; `options(parser)` adds the
    paper's own flags and `check(options, parser)` refuses bad ones."""

    description: str
    suites: dict[str, Suite]
    default_suite: str
    default_out: Path
    runner: Callable[[Options], Runner]
    announce: Callable[[str, list[Job], Options], str] = announce_runs
    tally: Callable[[list[Result]], str] | None = run_hours
    closing: Callable[[list[Result], Path, float], str] = wall_minutes
    options: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    out: Callable[[Options], Path] = lambda options: options.out
    check: Callable[[Options, argparse.ArgumentParser], None] = lambda options, parser: None
    suite_choice: bool = True


def parser_for(paper: Paper) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=paper.description.split("\n\n")[0])
    if paper.suite_choice:
        choices = [*paper.suites, "all"]
        parser.add_argument("--suite", choices=choices, default=paper.default_suite)
    paper.options(parser)
    parser.add_argument("--workers", type=int, default=2, help="runs at once (one core each)")
    parser.add_argument(
        "--together",
        action="store_true",
        help="every run in this process, their waiting tasks trained as one cohort "
        "(trainer=cohort; docs/running.md, a paper's grid on one GPU)",
    )
    parser.add_argument("--out", type=Path, default=paper.default_out)
    parser.add_argument("--report", action="store_true", help="tables of the runs already done")
    return parser


def main(paper: Paper, argv: Sequence[str] | None = None) -> None:
    """Run (or, with --report, only tabulate) the chosen suites of `paper`."""
    parser = parser_for(paper)
    options = parser.parse_args(argv)
    paper.check(options, parser)
    out = paper.out(options)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    chosen = getattr(options, "suite", paper.default_suite)
    everything: list[Result] = []
    for name in list(paper.suites) if chosen == "all" else [chosen]:
        everything += run_suite(paper, paper.suites[name], name, options, out)
    print(paper.closing(everything, out, (time.monotonic() - started) / 60), flush=True)


def run_suite(paper: Paper, suite: Suite, name: str, options: Options, out: Path) -> list[Result]:
    jobs = suite.jobs(options)
    print(paper.announce(name, jobs, options), flush=True)
    if options.report:
        results = finished(jobs, out)
    else:
        results = run_all(jobs, paper.runner(options), out, options.workers, options.together)
    table = suite.table(results, options)
    (out / suite.file).write_text(table + "\n")
    if suite.plot is not None and (results or suite.plot_empty):
        suite.plot(results, out / suite.png)
    print(table)
    if paper.tally is not None:
        print(paper.tally(results), flush=True)
    return results


# ---------------------------------------------------------------- seeds, flags, tables
def seed_flags(parser: argparse.ArgumentParser, seeded: str, default: int = 3) -> None:
    """--seeds (of the paper's own methods, `seeded`) and --seeds-all (of the rest)."""
    parser.add_argument("--seeds", type=int, default=default, help=f"seeds of {seeded}")
    parser.add_argument("--seeds-all", type=int, default=1, help="seeds of every other method")


def seed_first(
    seeds: int,
    seeds_all: int,
    seeded: Collection[str],
    cells: Iterable[Cell],
    method: Callable[[Cell], str] = lambda cell: cell[-1],  # type: ignore[index]
) -> Iterator[tuple[int, Cell]]:
    """(seed, cell) of the grid, seed 0 of every cell first, so that an interrupted grid has
    a whole table soonest: a cell whose method (by default its last item) is in `seeded`
    runs `seeds` seeds (--seeds), any other `seeds_all` (--seeds-all)."""
    cells = list(cells)
    for seed in range(max(seeds, seeds_all)):
        for cell in cells:
            if seed < (seeds if method(cell) in seeded else seeds_all):
                yield seed, cell


def subset_flag(parser: argparse.ArgumentParser, flag: str, known: Collection[str]) -> None:
    """--<flag>: a comma-separated subset of `known` (default: all of them)."""
    parser.add_argument(
        f"--{flag}", default=",".join(known), help=f"a comma-separated subset of {','.join(known)}"
    )


def check_subsets(
    options: Options, parser: argparse.ArgumentParser, known: dict[str, Collection[str]]
) -> None:
    """Refuse a subset flag naming what its paper does not have (one line, exit 2)."""
    for flag, names in known.items():
        chosen = [name for name in getattr(options, flag).split(",") if name]
        if unknown := set(chosen) - set(names):
            parser.error(f"unknown {flag} {sorted(unknown)}; choose from {','.join(names)}")


def subset(options: Options, flag: str) -> list[str]:
    return [name for name in getattr(options, flag).split(",") if name]


def table_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def pivot(
    rows: Iterable[Any],
    columns: Iterable[Any],
    cells: Callable[[Any, Any], list[str]],
    label: Callable[[Any], str] = str,
) -> list[str]:
    """A markdown table's body: a line per row key, its label, then each column's cells."""
    columns = list(columns)
    return [
        table_row([label(row), *(cell for column in columns for cell in cells(row, column))])
        for row in rows
    ]


# ---------------------------------------------------------------- the shared pieces
def curve(folder: Path, *fields: str) -> list[tuple[Any, ...]]:
    """(virtual time, fields...) of each evaluation in a run folder's metrics.jsonl."""
    from fedstale.server_app.results import read_jsonl

    rows = read_jsonl(folder / "metrics.jsonl")
    return [(row["virtual_time"], *(row[f] for f in fields)) for row in rows]


def time_to(result: Result, target: float, scale: float = 1.0) -> float | None:
    """Virtual time of the result's first evaluation at or above `target` (accuracies times
    `scale`: 100 for a target in percent), or None."""
    times = [point[0] for point in result["curve"]]
    return first_reach(times, [scale * point[1] for point in result["curve"]], target)


def mean_curve(rows: list[Result]) -> tuple[list[float], list[float]]:
    """Times and mean accuracy over the rows' curves, up to the shortest one."""
    length = min(len(r["curve"]) for r in rows)
    times = [rows[0]["curve"][i][0] for i in range(length)]
    return times, [statistics.mean(r["curve"][i][1] for r in rows) for i in range(length)]


@contextmanager
def figure(
    path: Path, panels: int, width: float, height: float = 4, **kwargs: Any
) -> Iterator[Any]:
    """`panels` axes side by side (matplotlib, no display); saved to `path` and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height), **kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
