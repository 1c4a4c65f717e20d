"""Whether a change left every golden run byte for byte as it was, on this machine: the
check behind "golden runs byte-identical before and after" (the golden test itself allows
the tolerances other CPUs need, tests/goldens.py).

    git worktree add /tmp/before <commit>
    (cd /tmp/before && python -m bench.golden_bytes --out /tmp/golden-before)
    python -m bench.golden_bytes --out /tmp/golden-after --against /tmp/golden-before

`--run-config "trainer=autograd"` runs every golden config with those keys over it (the
same on both sides), for a path the recorded goldens do not take, such as autograd on the
linear model.

Each golden config runs in this process (one thread), its metrics.jsonl (wall time aside)
and updates.jsonl written to OUT as <run>.<file>; with --against, every file is compared
with the same file there and each one that differs is named (exit 1).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from fedstale.launcher.launch import parse_pairs
from tests.goldens import STRATEGIES, produce


def produce_all(out: Path, only: list[str], extra: dict[str, Any] | None = None) -> list[str]:
    """Write every chosen golden run's files into `out`; their names."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as runs:
        for name in only or STRATEGIES:
            for file, text in produce(name, Path(runs), extra).items():
                (out / f"{name}.{file}").write_text(text)
                written.append(f"{name}.{file}")
            print(f"{name} done", flush=True)
    return written


def differing(written: list[str], out: Path, against: Path) -> list[str]:
    return [
        name
        for name in written
        if not (against / name).is_file()
        or (against / name).read_bytes() != (out / name).read_bytes()
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the files")
    parser.add_argument("--against", type=Path, help="a folder written earlier, to compare")
    parser.add_argument("--only", nargs="*", default=[], choices=STRATEGIES, metavar="RUN")
    parser.add_argument("--run-config", default="", help="key=value pairs over every config")
    args = parser.parse_args(argv)
    written = produce_all(args.out, args.only, parse_pairs(args.run_config))
    if args.against is None:
        return
    changed = differing(written, args.out, args.against)
    for name in changed:
        print(f"differs: {name}")
    print(f"{len(written) - len(changed)} of {len(written)} files byte-identical")
    if changed:
        sys.exit(1)


if __name__ == "__main__":
    main()
