"""fedstale's engine against Flower's own FedAvg, driving the same ClientApp in Flower
simulation with the same number of client trainings (issue 26: at most 5% more wall time).

The app is examples/async-quickstart copied into a temp folder, in three variants that
differ only in the strategy (its import and its line), none with an evaluate_fn:

  (a) Flower's `flwr.serverapp.strategy.FedAvg(fraction_train=1.0, fraction_evaluate=0.0)`,
      synchronous: R rounds over N nodes = R*N trainings;
  (b) fedstale's `FedAvg(concurrency=N, fraction_evaluate=0)`, R versions = R*N trainings;
  (c) fedstale's `FedBuff(buffer_size=N, concurrency=N, fraction_evaluate=0)`, R versions =
      R*N updates accepted; the trainings dispatched (summary.json `tasks_dispatched`)
      are more, as N stay in flight until the end.

Every variant also gets `min_available_nodes=N`. Each ServerApp times its own
`strategy.start` and writes the seconds to a JSON file, so the SuperLink's and Ray's
start-up (the same for all) is left out. Repetitions are interleaved (a, b, c, a, b, c, ...)
on one simulation SuperLink; the ratios are of the medians.

    python -m bench.library_overhead [--nodes 4] [--rounds 6] [--repeats 3]
        [--local-epochs 100] [--engine "poll_interval=0.005"] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedstale.launcher.deploy import CONNECTION, LocalDeployment
from fedstale.launcher.launch import to_flower, tool

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "async-quickstart"
DEFAULT_OUT = ROOT / "bench" / "results" / "library_overhead.json"
TARGET = 1.05  # fedstale's wall time at most 5% above Flower's FedAvg
VARIANTS = ("flower-fedavg", "fedstale-fedavg", "fedstale-fedbuff")

OLD_IMPORT = "from fedstale import FedBuff\n"
OLD_STRATEGY = (
    "    strategy = FedBuff(fraction_evaluate=fraction_evaluate, buffer_size=3, concurrency=4)\n"
)
OLD_START = "    result = strategy.start(\n"
OLD_EVALUATE = "        evaluate_fn=global_evaluate,\n    )\n"
BENCH_CODE = '''

def warm_up(grid: Grid, arrays: ArrayRecord, lr: float) -> float:
    """One training on every node before the clock starts (Ray's actors start, the
    ClientApp loads): the same in every variant. Its seconds."""
    started = time.perf_counter()
    config = ConfigRecord({"lr": lr})
    messages = [
        Message(RecordDict({"arrays": arrays, "config": config}), dst_node_id=node,
                message_type=MessageType.TRAIN)
        for node in grid.get_node_ids()
    ]
    grid.send_and_receive(messages, timeout=600)
    return time.perf_counter() - started


def constant_metrics(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """The evaluate_fn of every variant: no work (fedstale's summary needs a number)."""
    return MetricRecord({"accuracy": 0.0, "loss": 0.0})


def record_seconds(context: Context, seconds: float, warm: float) -> None:
    """The benchmark's clock: seconds spent in strategy.start, to run config bench-out."""
    with open(str(context.run_config["bench-out"]), "w") as out:
        json.dump({"seconds": seconds, "warm_up_seconds": warm}, out)
'''
IMPORTS = (
    "import json\nimport time\n\nimport torch\n"
    "from flwr.app import Message, MessageType, RecordDict\n"
)


def strategy_lines(variant: str, nodes: int, engine: str) -> tuple[str, str]:
    """(import line, strategy line) of one variant; `engine` is extra fedstale keywords."""
    extra = f", {engine}" if engine else ""
    if variant == "flower-fedavg":
        return (
            "from flwr.serverapp.strategy import FedAvg\n",
            f"FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes={nodes})",
        )
    if variant == "fedstale-fedavg":
        return (
            "from fedstale import FedAvg\n",
            f"FedAvg(concurrency={nodes}, fraction_evaluate=0, min_available_nodes={nodes}{extra})",
        )
    if variant == "fedstale-fedbuff":
        return (
            "from fedstale import FedBuff\n",
            f"FedBuff(buffer_size={nodes}, concurrency={nodes}, fraction_evaluate=0, "
            f"min_available_nodes={nodes}{extra})",
        )
    raise ValueError(f"unknown variant {variant!r}")


def replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise RuntimeError(f"the example's server_app.py changed: {old.strip()!r} not found once")
    return text.replace(old, new)


def server_source(source: str, variant: str, nodes: int, engine: str = "") -> str:
    """The example's server_app.py with the variant's strategy, no evaluate_fn, and
    `strategy.start` timed."""
    imported, line = strategy_lines(variant, nodes, engine)
    text = replace_once(source, "import torch\n", IMPORTS)
    text = replace_once(text, OLD_IMPORT, imported)
    text = replace_once(text, OLD_STRATEGY, f"    strategy = {line}\n")
    clock = "    warm = warm_up(grid, arrays, lr)\n    started = time.perf_counter()\n"
    text = replace_once(text, OLD_START, clock + OLD_START)
    text = replace_once(
        text,
        OLD_EVALUATE,
        "        evaluate_fn=constant_metrics,\n    )\n"
        "    record_seconds(context, time.perf_counter() - started, warm)\n",
    )
    return text + BENCH_CODE


def make_app(work: Path, variant: str, nodes: int, engine: str = "") -> Path:
    """A copy of the quickstart whose ServerApp runs `variant`."""
    app = work / variant / QUICKSTART.name
    shutil.copytree(QUICKSTART, app, ignore=shutil.ignore_patterns("__pycache__"))
    server = app / "asyncquickstart" / "server_app.py"
    server.write_text(server_source(server.read_text(), variant, nodes, engine))
    pyproject = app / "pyproject.toml"
    config = "[tool.flwr.app.config]\n"
    pyproject.write_text(replace_once(pyproject.read_text(), config, config + 'bench-out = ""\n'))
    return app


@dataclass
class Measured:
    variant: str
    repeat: int
    seconds: float  # in strategy.start
    process_seconds: float  # the whole `flwr run`, start-up included
    trainings: int  # train messages sent
    accepted: int  # updates aggregated
    warm_up_seconds: float = 0.0  # one training per node before the clock (Ray start-up)
    engine_seconds: dict[str, float] = field(default_factory=dict)


def flwr_run(
    link: LocalDeployment, app: Path, config: dict[str, Any], nodes: int, log: Path
) -> float:
    command = [tool("flwr"), "run", str(app), CONNECTION, "--stream"]
    command += ["--run-config", to_flower(config)]
    command += ["--federation-config", f"num-supernodes={nodes} client-resources-num-cpus=1"]
    env = {**link.env, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    started = time.monotonic()
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"`flwr run` failed, see {log}:\n{result.stderr[-2000:]}")
    return time.monotonic() - started


def measure(
    link: LocalDeployment, work: Path, app: Path, variant: str, repeat: int, args: Any
) -> Measured:
    out = work / f"{variant}-{repeat}.json"
    runs = work / "runs"
    before = set(runs.iterdir()) if runs.exists() else set()
    config = {
        "num-server-rounds": args.rounds,
        "local-epochs": args.local_epochs,
        "bench-out": str(out),
    }
    log = work / f"{variant}-{repeat}.log"
    process = flwr_run(link, app, config, args.nodes, log)
    if not out.is_file():
        raise RuntimeError(f"{variant}: the ServerApp wrote no timing; see {log}")
    timing = json.loads(out.read_text())
    seconds, warm = float(timing["seconds"]), float(timing["warm_up_seconds"])
    planned = args.rounds * args.nodes
    if variant == "flower-fedavg":
        return Measured(variant, repeat, seconds, process, planned, planned, warm)
    new = set(runs.iterdir()) - before
    if len(new) != 1:
        raise RuntimeError(f"{variant}: expected one new folder in {runs}, found {len(new)}")
    summary = json.loads((new.pop() / "summary.json").read_text())
    return Measured(
        variant,
        repeat,
        seconds,
        process,
        int(summary["tasks_dispatched"]),
        int(summary["updates_accepted"]),
        warm,
        dict(summary["engine_seconds"]),
    )


def median_of(rows: list[Measured], variant: str, key: str) -> float:
    return float(statistics.median(getattr(r, key) for r in rows if r.variant == variant))


def summarize(rows: list[Measured], args: Any) -> dict[str, Any]:
    """Medians per variant, the ratios against Flower's FedAvg and the verdict."""
    base = median_of(rows, "flower-fedavg", "seconds")
    variants: dict[str, Any] = {}
    for variant in VARIANTS:
        seconds = median_of(rows, variant, "seconds")
        trainings = median_of(rows, variant, "trainings")
        engine = [r.engine_seconds for r in rows if r.variant == variant and r.engine_seconds]
        variants[variant] = {
            "median_seconds": round(seconds, 3),
            "ratio": round(seconds / base, 4),
            "median_trainings": trainings,
            "median_accepted": median_of(rows, variant, "accepted"),
            "trainings_per_second": round(trainings / seconds, 3),
            "median_process_seconds": round(median_of(rows, variant, "process_seconds"), 2),
            "median_warm_up_seconds": round(median_of(rows, variant, "warm_up_seconds"), 2),
            "median_engine_seconds": {
                k: round(statistics.median(e.get(k, 0.0) for e in engine), 3)
                for k in sorted({k for e in engine for k in e})
            },
        }
    worst = max(variants[v]["ratio"] for v in VARIANTS[1:])
    return {
        "target_ratio": TARGET,
        "holds": worst <= TARGET,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "gpu": None},
        "load_average": os.getloadavg(),
        "variants": variants,
        "runs": [asdict(r) for r in rows],
    }


def report(result: dict[str, Any]) -> None:
    settings = result["settings"]
    print(
        f"{settings['nodes']} nodes, {settings['rounds']} rounds, local-epochs "
        f"{settings['local_epochs']}, {settings['repeats']} repeats interleaved; seconds "
        "in strategy.start (median)"
    )
    for name, row in result["variants"].items():
        print(
            f"  {name:17s} {row['median_seconds']:7.2f} s  ratio {row['ratio']:.3f}  "
            f"trainings {row['median_trainings']:.0f} ({row['trainings_per_second']:.2f}/s), "
            f"accepted {row['median_accepted']:.0f}"
        )
    for name in VARIANTS[1:]:
        print(f"ratio {name} / flower-fedavg: {result['variants'][name]['ratio']:.3f}")
    verdict = "holds" if result["holds"] else "does NOT hold"
    print(f"target: at most {result['target_ratio']:.2f}x Flower's FedAvg: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4, help="SuperNodes = clients N")
    parser.add_argument("--rounds", type=int, default=6, help="rounds / versions R")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--local-epochs", type=int, default=100, help="2.5-10 ms an epoch on 2 busy cores"
    )
    parser.add_argument(
        "--engine", default="", help="extra fedstale keywords, e.g. poll_interval=0.005"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedstale-library-bench-"))
    apps = {v: make_app(work, v, args.nodes, args.engine) for v in VARIANTS}
    here = Path.cwd()
    os.chdir(work)  # the ServerApp writes runs/ and final_model.pt here
    try:
        link = LocalDeployment(work / "home", 0, simulation=True).start()
    finally:
        os.chdir(here)
    rows: list[Measured] = []
    try:
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                rows.append(measure(link, work, apps[variant], variant, repeat, args))
                print(f"  {variant} #{repeat}: {rows[-1].seconds:.2f} s", flush=True)
    finally:
        link.stop()
    result = summarize(rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    print(f"written {args.out} (apps and logs in {work})")


if __name__ == "__main__":
    main()
