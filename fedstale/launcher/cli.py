"""`fedstale`: check a run config, then run the app in Flower simulation or locally.

    fedstale check [--run-config "k=v ..."] [--federation-config "k=v ..."]
    fedstale run   [--run-config "k=v ..."] [--federation-config "k=v ..."] [--app DIR]
                   [--superlink NAME] [--overwrite]
    fedstale run --local [--workers N] [--run-config "k=v ..."] [--app DIR]
                   (no Flower: the same engine, clients trained in N processes)
    fedstale run --local [--seeds 0,1,2] [--grid "k=v1,v2 ..."] [--run-config "k=v ..."]
                   (a grid's runs in one process, their tasks trained together: grid.py)
    fedstale compare RUN... [--last K] [--target ACC] [--out DIR]
                   (runs on one plot and one table: fedstale/launcher/compare.py)
    fedstale deploy --nodes N [--delays s,s,...] [--tls] [--run-config "k=v ..."]
                   (a local SuperLink and N SuperNodes: fedstale/launcher/deploy.py)
    fedstale track RUN_FOLDER... --to mlflow[,tensorboard,wandb] [--tracking-uri URI]
                   (earlier runs into experiment trackers: fedstale/launcher/track.py)

`flwr run` exits 0 even when the ServerApp fails, and only sees a bad value once the
simulation is up. `fedstale run` validates the fused config first (one line and exit 2 on a
problem), sizes the federation to `num-clients`, sends results to `<app>/runs/` (`./runs/`
outside a checkout, where the app installed with the package runs) and exits non-zero
unless the run wrote its summary. On Flower's `local` connection it starts the local
SuperLink itself and stops it afterwards (fedstale/launcher/local_link.py). A RAY_ADDRESS in
the environment is checked first and reaches the simulation through that SuperLink: the
simulation then joins that running Ray cluster (fedstale/launcher/ray_cluster.py). `--local`
runs the same engine and client code in this process, the clients' tasks on `--workers`
cores; on the virtual clock its results equal Flower simulation's for the same seed. String
values need no quotes here (`strategy=fedasync` works; Flower itself wants
`strategy='fedasync'`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedstale.common.config import ConfigError, RunConfig
from fedstale.launcher import compare, deploy, track
from fedstale.launcher.grid import parse_axes, run_grid
from fedstale.launcher.launch import (
    federation_options,
    find_app,
    finished,
    flower_app,
    flower_env,
    hint_for,
    merged_pairs,
    preflight,
    report,
    to_flower,
    tool,
)
from fedstale.launcher.local_link import owned_local_superlink
from fedstale.launcher.ray_cluster import RAY_ADDRESS, ray_cluster
from fedstale.launcher.relay import Relayed
from fedstale.server_app.checkpoint import CHECKPOINT_FILE
from fedstale.server_app.engine import EngineError
from fedstale.server_app.heartbeat import STALE_SECONDS, server_died
from fedstale.server_app.results import runs_root
from fedstale.server_app.stages.central_dp import dominance_notes
from fedstale.strategies.registry import package_rules


def flower_command(
    app: Path, overrides: dict[str, Any], federation: str, run: RunConfig, superlink: str
) -> list[str]:
    fed_values = federation_options(federation)
    fed_values.setdefault("num-supernodes", run.num_clients)
    # Flower's Ray backend gives each ClientApp 2 CPUs unless told otherwise: one actor on a
    # 2-core box. A ClientApp uses `client-threads` torch threads (1 by default).
    fed_values.setdefault("client-resources-num-cpus", max(1, run.client_threads))
    return [
        tool("flwr"),
        "run",
        str(app),
        *([superlink] if superlink else []),
        "--stream",
        "--run-config",
        to_flower(overrides),
        "--federation-config",
        to_flower(fed_values),
    ]


def run_simulation(app: Path, pairs: dict[str, Any], federation: str, superlink: str = "") -> int:
    # On the simulation it starts itself every node can load every partition: the server
    # assigns them and asks no node anything before its first task (unless the run config
    # says otherwise). A SuperLink named by --superlink may be a deployment's: nodes asked.
    if not superlink:
        pairs = {"node-partitions": "assign", **pairs}
    run, _, overrides = preflight(app, pairs, federation)
    cluster = ray_cluster(os.environ, federation_options(federation))
    run_dir = runs_root(run.runs_dir) / run.run_name
    with flower_app(app) as target:
        command = flower_command(target, overrides, federation, run, superlink)
        staged = f" ({target}: the files of {app} that its FAB holds)" if target != app else ""
        print("fedstale: " + shlex.join(command) + staged, file=sys.stderr)
        started = time.time()
        with owned_local_superlink(superlink) as link:
            if cluster is not None:
                print(cluster_note(cluster, link.process is not None), file=sys.stderr)
            flower = Relayed(command, {**flower_env(), **link.env})
            died = follow(flower.process, run_dir, started)
            flower.finish()
    return report(run, run_dir, started, failure_message(run_dir, died, pairs, superlink))


def cluster_note(address: str, own_superlink: bool) -> str:
    """What becomes of RAY_ADDRESS: the simulation process inherits the SuperLink's
    environment, so it reaches only a SuperLink started with it."""
    if own_superlink:
        return f"fedstale: the simulation joins the Ray cluster at {address} ({RAY_ADDRESS})"
    return (
        f"fedstale: {RAY_ADDRESS}={address} reaches the simulation only through the "
        "SuperLink's environment; this SuperLink was not started by fedstale run, so it "
        f"uses the {RAY_ADDRESS} it was started with"
    )


# Measured on an H200 (bench.gpu, FedBuff, LeNet): 1, 2 and 4 worker processes sharing the
# GPU ran at 1.15x, 1.01x and 1.26x the bare loop; trainer=cohort at 1.76x.
ONE_GPU = (
    "device {device}: clients train in this process (worker processes share one GPU and "
    "added nothing measured: 1.01-1.26x the bare loop against 1.15x for one); "
    "trainer=cohort trains the waiting tasks together (1.76x), --workers N spawns anyway"
)


def local_workers(run: RunConfig, asked: int | None) -> int:
    """How many processes train the clients: as asked; else one on a GPU (said), else every
    core; never more than the tasks in flight."""
    if asked is None and run.trainer != "cohort":
        from fedstale.common.models import resolve_device

        device = resolve_device(run.device)
        if device.type == "cuda":
            print(f"fedstale: {ONE_GPU.format(device=device)}", file=sys.stderr)
            asked = 1
    return min(asked or len(os.sched_getaffinity(0)), run.concurrency)


def run_local(app: Path, pairs: dict[str, Any], asked: int | None) -> int:
    """The engine in this process, clients' tasks on worker processes (1: in this one)."""
    # The launcher joins both sides, as `flwr run` does; server_app's modules never do.
    from fedstale.launcher.local import cohort_transport, local_transport, pooled_transport
    from fedstale.server_app.app import setup_logging
    from fedstale.server_app.experiment import run_experiment

    run, params, _ = preflight(app, pairs)
    setup_logging()
    workers = local_workers(run, asked)
    run_dir = runs_root(run.runs_dir) / run.run_name
    where = "this process, in cohorts" if run.trainer == "cohort" else f"{workers} worker(s)"
    print(f"fedstale: {run.run_name} locally on {where}", file=sys.stderr)
    started = time.time()
    try:
        if run.trainer == "cohort":
            run_experiment(run, params, cohort_transport(run))
        elif workers == 1:
            run_experiment(run, params, local_transport(run))
        else:
            with pooled_transport(run, workers) as transport:
                run_experiment(run, params, transport)
    except EngineError as err:
        print(f"fedstale: {err}", file=sys.stderr)
    except KeyboardInterrupt:
        print("fedstale: interrupted", file=sys.stderr)
    failure = failure_message(run_dir, False, pairs, "", local=True)
    return report(run, run_dir, started, failure)


def follow(flower: subprocess.Popen, run_dir: Path, started: float) -> bool:
    """Wait for `flwr run` to end; True when the ServerApp died under it."""
    while flower.poll() is None:
        time.sleep(1.0)
        if server_died(run_dir, started) and not finished(run_dir, started):
            flower.terminate()  # only the streaming client; Flower notices the dead run later
            flower.wait(30)
            return True
    return False


def failure_message(
    run_dir: Path, died: bool, pairs: dict[str, Any], superlink: str, local: bool = False
) -> str:
    """One line on what happened, and the command that resumes when a checkpoint exists."""
    if died:
        head = (
            f"fedstale: the ServerApp died: its heartbeat in {run_dir} stopped "
            f"{STALE_SECONDS:g} s ago and no summary.json was written"
        )
    else:
        head = f"fedstale: the run failed (no {run_dir / 'summary.json'}); see the log above"
    saved = run_dir / CHECKPOINT_FILE
    if not saved.is_file():
        return head
    pairs = {**pairs, "run-name": run_dir.name, "resume-from": str(run_dir)}
    resume = [tool("fedstale"), "run", *(["--superlink", superlink] if superlink else [])]
    resume += ["--local"] if local else []
    resume += ["--run-config", to_flower(pairs)]
    return f"{head}\nfedstale: resume from its last checkpoint with:\n  {shlex.join(resume)}"


def stop_on_sigterm() -> None:
    """SIGTERM (a `kill`, a timeout) unwinds like Ctrl-C, so what the run started is
    stopped on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main(argv: list[str] | None = None) -> int:
    """The `fedstale` command. SIGTERM unwinds it (`stop_on_sigterm`) while it runs; the
    caller's own handler is back when it returns, so an in-process caller (a test run, a
    notebook) keeps its behaviour: a SIGTERM meant for pytest ended whichever test was
    running as 'SystemExit 143' and the session went on, once this handler had leaked."""
    argv = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is not threading.main_thread():
        return command(argv)
    previous = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm()
    try:
        return command(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


COMMANDS = ("check", "run", "deploy", "compare", "track")
APP_HELP = (
    "the fedstale app directory (default: the current one when it is a fedstale checkout, "
    "else the app installed with the package, runs in ./runs)"
)


def version_line() -> str:
    from fedstale import __version__
    from fedstale.server_app.provenance import version_of

    return f"fedstale {__version__} (flwr {version_of('flwr')}, torch {version_of('torch')})"


def top_parser() -> argparse.ArgumentParser:
    """`fedstale --help`: the subcommands, each with a --help of its own."""
    parser = argparse.ArgumentParser(
        prog="fedstale",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=COMMANDS, help="see `fedstale COMMAND --help`")
    parser.add_argument("--version", action="version", version=version_line())
    return parser


def run_parser(name: str) -> argparse.ArgumentParser:
    """`fedstale check` and `fedstale run`."""
    what = {"check": "validate a run config", "run": "run the app (Flower, or --local)"}
    parser = argparse.ArgumentParser(prog=f"fedstale {name}", description=what[name])
    parser.add_argument(
        "--run-config",
        action="append",
        help="key=value pairs over the defaults (repeatable: later ones win)",
    )
    parser.add_argument("--federation-config", default="", help="Flower simulation options")
    parser.add_argument("--app", type=Path, default=None, help=APP_HELP)
    if name == "check":
        parser.set_defaults(
            superlink="", local=False, overwrite=False, workers=None, seeds="", grid=""
        )
        return parser
    parser.add_argument(
        "--superlink", default="", help="SuperLink connection name (default: Flower's default)"
    )
    parser.add_argument(
        "--local", action="store_true", help="run without Flower, clients on local cores"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="reuse a run-name whose folder holds a run (that run is moved aside, not deleted)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="with --local: processes training clients (default: the core count)",
    )
    parser.add_argument(
        "--seeds",
        default="",
        help="with --local: run each of these seeds (0,1,2), as one grid in this process",
    )
    parser.add_argument(
        "--grid",
        default="",
        help='with --local: a run per combination of "key=v1,v2 ..." (with --seeds), every '
        "run's waiting tasks trained together; rerun the same command to resume",
    )
    return parser


def command(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        top_parser().parse_args(argv[:1] or ["--help"])
    name, rest = argv[0], argv[1:]
    if name == "compare":
        return compare.main(rest)
    if name in ("deploy", "track"):
        try:
            return (deploy.main if name == "deploy" else track.main)(rest)
        except ConfigError as err:
            print(f"fedstale: {hint_for(str(err), None)}", file=sys.stderr)
            return 2
    parser = run_parser(name)
    args = parser.parse_args(rest)
    local, workers, superlink = args.local, args.workers, args.superlink
    if not local and workers is not None:
        parser.error("--workers goes with --local")
    if local and (superlink or args.federation_config):
        parser.error("--local runs without Flower; drop --superlink and --federation-config")
    if workers is not None and workers < 1:
        parser.error("--workers must be at least 1")
    grid = name == "run" and bool(args.seeds or args.grid)
    if grid and not local:
        parser.error("--seeds and --grid go with --local (a grid runs in this process)")
    if grid and workers is not None:
        parser.error("--workers goes without --grid: a grid trains its runs' tasks together here")
    try:
        app = find_app(args.app)
        pairs = merged_pairs(args.run_config)
        if args.overwrite:
            pairs["overwrite"] = True
        if name == "check":
            run, params, _ = preflight(app, pairs, args.federation_config)
            ray_cluster(os.environ, federation_options(args.federation_config))
            for note in dominance_notes(run, params):
                print(f"fedstale: DP: {note}", file=sys.stderr)
            print(f"fedstale: config ok ({run.strategy} on {run.dataset})", file=sys.stderr)
            for line in package_rules():
                print(f"fedstale: installed {line}", file=sys.stderr)
            return 0
        if grid:
            return run_grid(app, pairs, parse_axes(args.grid, args.seeds))
        if local:
            return run_local(app, pairs, workers)
        return run_simulation(app, pairs, args.federation_config, superlink)
    except ConfigError as err:
        print(f"fedstale: {hint_for(str(err), args.app)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
