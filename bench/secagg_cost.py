"""What secure aggregation costs per update (issue 67): bytes on the wire and client and
server seconds, secure against plain FedBuff on the same runs, and the accuracy of both.

    python -m bench.secagg_cost [--clients 10,50,100,200] [--model linear] [--updates 600]
        [--out DIR]
    python -m bench.secagg_cost --door simulation --clients 10,50 --updates 200
    python -m bench.secagg_cost --door deploy --clients 10 --updates 200

Protocol: Fashion-MNIST (or `--dataset digits`), fedstale's IID partition, FedBuff with
K = 10 and 10 tasks in flight, `--updates` client updates, the same seed for the plain and
the secure run (`--local`, one worker, so the client's and the server's seconds are
measured in one process); N holders = the clients, T = N // 3, U = N - N // 3 (the
defaults). Per update:

- bytes: plain, the model down and the delta up (float32); secure, the same model down plus
  the holders' keys, the masked update up (uint64), its N sealed shares up, and, per
  buffer, the shares and keys sent to the holders and their answers, divided by the
  updates (summary.json's counts);
- client seconds: the train function alone, and what masking adds (quantise, mask, encode,
  seal), a holder's check of the shares it is sent (open each) and its answer;
- server seconds: the engine's time per update (summary.json `engine_seconds`, less the
  clients' work it ran in process), of which unmasking.

`--door simulation` (`fedstale run`, Flower simulation) and `--door deploy` (`fedstale
deploy`: a SuperLink and N SuperNodes on this machine) run the same pairs through Flower:
there the clients' and the server's seconds cannot be told apart, so the table gives the
wall milliseconds per update (summary.json's `wall_seconds` over the updates) and the
bytes of the protocol, secure against plain.

Writes results.jsonl and table.md to --out (default runs/secagg-cost-<UTC time>; an
existing folder is refused).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fedstale.client_app import secagg as client_half  # noqa: E402
from fedstale.client_app.task import evaluate_task, train_task  # noqa: E402
from fedstale.common.secagg import protocol as wire  # noqa: E402
from fedstale.launcher.inprocess import InProcessTransport  # noqa: E402

BUFFER = 10
FLOAT_BYTES = 4


@dataclass
class ClientClock:
    """Client seconds, split: training, masking, checking shares and answering as a holder."""

    train: float = 0.0
    mask: float = 0.0
    check: float = 0.0
    answer: float = 0.0


class TimedClients(InProcessTransport):
    def __init__(self, run: Any) -> None:
        self.clock = ClientClock()
        super().__init__(run, self.timed, evaluate_task)

    def timed(self, cfg, partition, config, arrays, sets=None, state=None):  # type: ignore[no-untyped-def]
        clock = self.clock

        def trained(*args: Any) -> Any:
            start = time.perf_counter()
            out = train_task(*args)
            clock.train += time.perf_counter() - start
            return out

        stage = config.get(wire.STAGE)
        start = time.perf_counter()
        if stage is None:
            return trained(cfg, partition, config, arrays, sets, state)
        before = clock.train
        out = client_half.secure_train(trained, cfg, partition, config, arrays, sets, state)
        spent = time.perf_counter() - start - (clock.train - before)
        if stage == wire.UNMASK:
            clock.answer += spent
        elif stage == wire.CHECK:
            clock.check += spent
        else:
            clock.mask += spent
        return out


def one_run(clients: int, secure: bool, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from fedstale.server_app.experiment import run_experiment
    from fedstale.strategies.registry import load_config

    name = f"{'secure' if secure else 'plain'}-n{clients}"
    values = {
        "strategy": "fedbuff",
        "dataset": args.dataset,
        "model": args.model,
        "num-clients": clients,
        "concurrency": BUFFER,
        "buffer-size": BUFFER,
        "max-updates": args.updates,
        "max-virtual-time": 0.0,
        "eval-interval": 1e12,
        "checkpoint-every": 0,
        "seed": 1,
        "secure-aggregation": secure,
        "runs-dir": str(out / "runs"),
        "run-name": name,
    }
    run, params = load_config(values)
    transport = TimedClients(run)
    started = time.perf_counter()
    summary = run_experiment(run, params, transport)
    wall = time.perf_counter() - started
    updates = summary["updates_accepted"]
    size = model_size(args)
    clock = transport.clock  # in process the engine's seconds include the clients' work
    holders = clock.check + clock.answer
    engine = sum(summary["engine_seconds"].values()) - clock.train - clock.mask - holders
    secure_counts = summary.get("secure_aggregation", {})
    plain_bytes = 2 * size * FLOAT_BYTES  # the model down, the delta up
    wire_bytes = (
        size * FLOAT_BYTES + (secure_counts["bytes_in"] + secure_counts["bytes_out"]) / updates
        if secure
        else plain_bytes
    )
    return {
        "run": name,
        "clients": clients,
        "secure": secure,
        "parameters": size,
        "updates": updates,
        "versions": summary["versions"],
        "final_accuracy": summary["final_accuracy"],
        "bytes_per_update": wire_bytes,
        "client_train_ms": 1e3 * transport.clock.train / updates,
        "client_mask_ms": 1e3 * transport.clock.mask / updates,
        "client_check_ms": 1e3 * transport.clock.check / updates,
        "client_answer_ms": 1e3 * transport.clock.answer / updates,
        "server_ms": 1e3 * engine / updates,
        # in process the unmask round includes the holders' answers: the server's share only
        "unmask_ms": 1e3 * (secure_counts.get("unmask_seconds", 0.0) - holders) / updates,
        "wall_ms": 1e3 * wall / updates,
        "error_bound": secure_counts.get("error_bound_max", 0.0),
        "recovery": secure_counts.get("recovery_threshold"),
        "privacy": secure_counts.get("privacy_threshold"),
    }


def flower_run(clients: int, secure: bool, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One run through Flower (`fedstale run` in simulation, or `fedstale deploy`)."""
    import subprocess

    name = f"{args.door}-{'secure' if secure else 'plain'}-n{clients}"
    pairs = (
        f"strategy='fedbuff' dataset='{args.dataset}' model='{args.model}' "
        f"num-clients={clients} concurrency={BUFFER} buffer-size={BUFFER} "
        f"max-updates={args.updates} max-virtual-time=0 eval-interval=1e12 checkpoint-every=0 "
        f"seed=1 secure-aggregation={'true' if secure else 'false'} "
        f"runs-dir='{out / 'runs'}' run-name='{name}'"
    )
    command = [sys.executable, "-m", "fedstale.launcher.cli"]
    if args.door == "deploy":
        command += ["deploy", "--nodes", str(clients), "--timeout", "3000"]
    else:
        command += ["run"]
    done = subprocess.run(
        [*command, "--run-config", pairs], cwd=ROOT, capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
    summary = json.loads((out / "runs" / name / "summary.json").read_text())
    updates = summary["updates_accepted"]
    size = model_size(args)
    counts = summary.get("secure_aggregation", {})
    wire_bytes = (
        size * FLOAT_BYTES + (counts["bytes_in"] + counts["bytes_out"]) / updates
        if secure
        else 2 * size * FLOAT_BYTES
    )
    return {
        "run": name,
        "door": args.door,
        "clients": clients,
        "secure": secure,
        "updates": updates,
        "final_accuracy": summary["final_accuracy"],
        "bytes_per_update": wire_bytes,
        "wall_ms": 1e3 * summary["wall_seconds"] / updates,
        "recovery": counts.get("recovery_threshold"),
        "privacy": counts.get("privacy_threshold"),
    }


def model_size(args: argparse.Namespace) -> int:
    from fedstale.common.models import build_model

    shape = (1, 28, 28) if args.dataset == "fmnist" else (1, 8, 8)
    return sum(p.numel() for p in build_model(args.model, shape, 10, 0).parameters())


LOCAL_COLUMNS = (
    ("client train ms", lambda r, ref: f"{r['client_train_ms']:.2f}"),
    ("client mask ms", lambda r, ref: f"{r['client_mask_ms']:.2f}"),
    ("holder check ms", lambda r, ref: f"{r.get('client_check_ms', 0.0):.2f}"),
    ("holder answer ms", lambda r, ref: f"{r['client_answer_ms']:.2f}"),
    ("server ms (of which unmask)", lambda r, ref: f"{r['server_ms']:.2f} ({r['unmask_ms']:.2f})"),
)
FLOWER_COLUMNS = (
    ("wall ms / update", lambda r, ref: f"{r['wall_ms']:.1f}"),
    ("x plain", lambda r, ref: f"{r['wall_ms'] / ref['wall_ms']:.2f}"),
)


def table(rows: list[dict[str, Any]], door: str = "local") -> str:
    """Each run beside the plain run of its N: bytes, then the door's seconds."""
    columns = LOCAL_COLUMNS if door == "local" else FLOWER_COLUMNS
    plain = {(r.get("door"), r["clients"]): r for r in rows if not r["secure"]}
    names = ["clients N", "T / U", "run", "bytes / update", "x plain", *(n for n, _ in columns)]
    lines = [f"| {' | '.join(names)} | final acc |", "| ---" * (len(names) + 1) + " |"]
    for row in rows:
        reference = plain.get((row.get("door"), row["clients"]), row)
        thresholds = f"{row['privacy']} / {row['recovery']}" if row["secure"] else "-"
        cells = [
            str(row["clients"]),
            thresholds,
            " ".join([row.get("door", "local"), "secure" if row["secure"] else "plain"]),
            f"{row['bytes_per_update']:,.0f}",
            f"{row['bytes_per_update'] / reference['bytes_per_update']:.2f}",
            *(cell(row, reference) for _, cell in columns),
            f"{row['final_accuracy']:.4f}",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,50,100,200")
    parser.add_argument("--updates", type=int, default=600)
    parser.add_argument("--dataset", default="fmnist")
    parser.add_argument("--model", default="linear")
    parser.add_argument("--door", choices=["local", "simulation", "deploy"], default="local")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import logging

    from fedstale.server_app.app import setup_logging

    setup_logging()
    logging.getLogger("fedstale").setLevel(logging.WARNING)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or ROOT / "runs" / f"secagg-cost-{stamp}"
    if out.exists():
        print(f"secagg_cost: {out} exists; name a new --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True)
    rows = []
    with (out / "results.jsonl").open("a") as results:
        for clients in (int(c) for c in args.clients.split(",")):
            for secure in (False, True):
                run_one = one_run if args.door == "local" else flower_run
                row = run_one(clients, secure, args, out)
                rows.append(row)
                results.write(json.dumps(row) + "\n")
                results.flush()
                print(f"{row['run']}: {row['bytes_per_update']:,.0f} B/update", flush=True)
    text = table(rows, args.door)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
