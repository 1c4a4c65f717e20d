"""How far the golden runs drift when the CPU's kernels change, and the tolerances the golden
test allows (tests/golden/tolerances.json).

    python -m bench.golden_drift [--jobs 2] [--write] [--only NAME ...]

Each setting below reruns every golden config (tests/goldens.py) in a fresh process whose
environment picks other kernels: torch's ATen vector width, MKL's instruction set, numpy's
OpenBLAS core type. Against the recorded files, every integer, string and virtual time must
be equal (else the event sequence itself depends on the CPU, and this design does not
hold: exit 1). `--only` reruns some golden runs (those whose files were rewritten) and,
with `--write`, replaces their tolerances and keeps the others'. For every float field the
largest relative drift over all settings is printed; with `--write` the tolerance becomes
FACTOR times it, rounded up to one significant digit (a field that never drifted is
compared to a few ulps), and accuracies are allowed ACCURACY_FLOOR whatever was measured,
since an accuracy is a count of predictions: a logit margin below the drift flips one
(none seen here; FedQS and PACE drift most).

FACTOR = 100 is headroom for CPUs that differ more than these settings do (another vector
width, an aarch64 build without MKL): the recorded files come from another x86 machine, and
its drift against this one was of the order of the settings' (1e-7 on a loss). A change of a
rule is far outside: FedBuff's step scaled by 1.01 moves the losses by 1e-2 relative (and
1.001 by 1e-3), against a measured drift of 1e-7; tests/test_golden.py checks such changes
fail under whatever kernels run the suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.goldens import (
    FILES,
    STRATEGIES,
    TOLERANCES,
    compare_rows,
    produce,
    recorded,
    rows,
)

SETTINGS: dict[str, dict[str, str]] = {
    "as-is": {},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "openblas-haswell": {"OPENBLAS_CORETYPE": "Haswell"},
    "aten-default-mkl-sse42-1-thread": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "OMP_NUM_THREADS": "1",
    },
}
FACTOR = 100.0
ACCURACY_FLOOR = 1e-3  # ten of Fashion-MNIST's 10,000 test images; one of 20 in a client mean
ACCURACY_FIELDS = ("accuracy", "accuracy_std")
Drifts = dict[str, dict[str, dict[str, float]]]  # strategy -> file -> field -> drift


def record(out: Path, names: list[str]) -> None:
    """The golden runs `names`, in this process, into out/<strategy>/."""
    import logging

    logging.disable(logging.WARNING)
    for strategy in names:
        texts = produce(strategy, out / "runs")
        (out / strategy).mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (out / strategy / name).write_text(text)
        print(f"  {strategy}", file=sys.stderr, flush=True)


def record_under(setting: str, out: Path, names: list[str]) -> Path:
    env = {**os.environ, **SETTINGS[setting], "FEDSTALE_UPDATE_GOLDEN": ""}
    target = out / setting
    command = [sys.executable, "-m", "bench.golden_drift", "--record", str(target)]
    command += ["--only", *names]
    print(f"{setting}: {' '.join(f'{k}={v}' for k, v in SETTINGS[setting].items())}")
    subprocess.run(command, env=env, check=True, cwd=Path(__file__).resolve().parent.parent)
    return target


def drift_of(folder: Path, names: list[str]) -> tuple[Drifts, list[str]]:
    """Each float field's largest relative drift against the recorded files, and every
    difference of what must be exact."""
    drifts: Drifts = {}
    exact: list[str] = []
    for strategy in names:
        golden = recorded(strategy)
        for name in FILES:
            produced = (folder / strategy / name).read_text()
            problems, drift = compare_rows(rows(produced), rows(golden[name]), {})
            exact += [f"{strategy} {name} {p}" for p in problems if "tolerance" not in p]
            fields = drifts.setdefault(strategy, {}).setdefault(name, {})
            for key, found in drift.items():
                fields[key] = max(fields.get(key, 0.0), found.value)
    return drifts, exact


def merge(total: Drifts, more: Drifts) -> None:
    for strategy, files in more.items():
        for name, fields in files.items():
            kept = total.setdefault(strategy, {}).setdefault(name, {})
            for key, value in fields.items():
                kept[key] = max(kept.get(key, 0.0), value)


def round_up(value: float) -> float:
    """Up to one significant digit: 3.2e-5 -> 4e-5."""
    exponent = math.floor(math.log10(value))
    return float(f"{math.ceil(value / 10**exponent)}e{exponent}")


def tolerances(drifts: Drifts) -> Drifts:
    table: Drifts = {}
    for strategy, files in drifts.items():
        for name, fields in files.items():
            for key, value in fields.items():
                allowed = round_up(FACTOR * value) if value > 0 else 0.0
                if key in ACCURACY_FIELDS:
                    allowed = max(allowed, ACCURACY_FLOOR)
                if allowed:
                    table.setdefault(strategy, {}).setdefault(name, {})[key] = allowed
    return table


def machine() -> str:
    import torch

    model = platform.processor() or platform.machine()
    with open("/proc/cpuinfo", encoding="utf-8") as handle:
        names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    if names:
        model = names[0]
    return f"{model} ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="settings recorded at once")
    parser.add_argument("--write", action="store_true", help=f"write {TOLERANCES.name}")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=STRATEGIES,
        default=STRATEGIES,
        metavar="NAME",
        help="these golden runs alone (with --write, the others' tolerances are kept)",
    )
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = list(args.only)
    if args.record:
        record(args.record, names)
        return 0
    with tempfile.TemporaryDirectory(prefix="golden-drift-") as tmp:
        with ThreadPoolExecutor(args.jobs) as pool:
            folders = list(pool.map(lambda s: record_under(s, Path(tmp), names), SETTINGS))
        total: Drifts = {}
        broken: list[str] = []
        for setting, folder in zip(SETTINGS, folders, strict=True):
            drifts, exact = drift_of(folder, names)
            merge(total, drifts)
            broken += [f"{setting}: {line}" for line in exact]
    for strategy, files in total.items():
        cells = [
            f"{key} {value:.1e}" for name in FILES for key, value in files.get(name, {}).items()
        ]
        print(f"{strategy:16} " + (", ".join(cells) or "no float drift"))
    if broken:
        print("\n".join(["exact fields differ:", *broken[:20]]))
        return 1
    if args.write:
        kept = json.loads(TOLERANCES.read_text()) if names != STRATEGIES else {}
        for part in ("measured", "tolerance"):  # the rerun runs' entries are replaced whole
            kept[part] = {k: v for k, v in kept.get(part, {}).items() if k not in names}
        document = {
            "how": "python -m bench.golden_drift --write (its docstring says how)",
            "machine": machine(),
            "settings": SETTINGS,
            "factor": FACTOR,
            "measured": {**kept.get("measured", {}), **total},
            "tolerance": {**kept.get("tolerance", {}), **tolerances(total)},
        }
        TOLERANCES.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
        print(f"wrote {TOLERANCES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
