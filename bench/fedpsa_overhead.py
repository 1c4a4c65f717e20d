"""FedPSA's client overhead: sensitivity + sketch time as a fraction of local training
(E = 5) for the linear model (with either `trainer`) and the MNIST CNN, and the peak extra
memory of sensitivity + sketch for a model of >= 1.5 M parameters. Targets: <= 10% of
training, <= 64 MB.

    python -m bench.fedpsa_overhead [--repeats 5]

Training data: one Fashion-MNIST client's share (1,080 samples; MNIST is not offline here,
and the MNIST CNN takes the same 1x28x28 input). One torch thread, as a simulated client.
Memory: measured in a fresh process; extra = the highest resident set size seen while
sensitivity + sketch run (sampled every millisecond) minus the size just before (model and
batch already built).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import torch

from fedstale.common.calibration import gaussian_batch
from fedstale.common.config import parse_run_config
from fedstale.common.federation import FederationKey
from fedstale.common.models import MLP, build_model
from fedstale.common.sensitivity import sensitivity, sketch
from fedstale.common.shares import client_data
from fedstale.common.training import local_train

K, CALIB = 16, 32


def timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up (torch.func traces on first use)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead(model_name: str, trainer: str, repeats: int) -> dict:
    cfg = parse_run_config({})
    x, y = client_data(FederationKey.of(cfg), 0)
    model = build_model(model_name, (1, 28, 28), 10, seed=0)
    batch = gaussian_batch(0, (1, 28, 28), 10, CALIB)
    train = timed(
        lambda: local_train(
            model, x, y, epochs=5, batch_size=64, lr=0.01, seed=0, closed_form=trainer == "auto"
        ),
        repeats,
    )
    signal = timed(lambda: sketch(sensitivity(model, *batch), K, seed=0), repeats)
    params = sum(p.numel() for p in model.parameters())
    return {"model": model_name, "params": params, "train_s": train, "signal_s": signal}


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(row for row in status if row.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def peak_memory_child(hidden: int) -> None:
    """Runs in a fresh process: print the peak resident-memory growth of sensitivity +
    sketch, sampled every millisecond by a watcher thread."""
    torch.set_num_threads(1)
    model = MLP(in_features=784, num_classes=10, hidden=hidden)
    batch = gaussian_batch(0, (1, 28, 28), 10, CALIB)
    small = MLP(in_features=784, num_classes=10, hidden=4)
    sketch(sensitivity(small, *batch), K, seed=0)  # load torch.func's code before measuring
    params = sum(p.numel() for p in model.parameters())
    baseline, peak, done = rss_mb(), [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    sketch(sensitivity(model, *batch), K, seed=0)
    done.set()
    watcher.join()
    peak[0] = max(peak[0], rss_mb())
    weights_mb = params * 4 / 2**20
    print(json.dumps({"params": params, "extra_mb": peak[0] - baseline, "model_mb": weights_mb}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        peak_memory_child(args.memory_child)
        return
    torch.set_num_threads(1)
    for name, trainer in (("linear", "auto"), ("linear", "autograd"), ("cnn-mnist", "auto")):
        row = overhead(name, trainer, args.repeats)
        share = row["signal_s"] / row["train_s"]
        print(
            f"{name:10s} trainer={trainer:8s} {row['params']:>9,} params: "
            f"training {row['train_s'] * 1000:7.1f} ms, "
            f"sensitivity + sketch {row['signal_s'] * 1000:6.1f} ms = {share:.1%} (target <= 10%)"
        )
    child = subprocess.run(
        [sys.executable, "-m", "bench.fedpsa_overhead", "--memory-child", "2000"],
        capture_output=True,
        text=True,
        check=True,
    )
    memory = json.loads(child.stdout)
    print(
        f"MLP 784-2000-10 {memory['params']:,} params ({memory['model_mb']:.1f} MB of weights): "
        f"peak extra memory of sensitivity + sketch {memory['extra_mb']:.1f} MB (target <= 64 MB)"
    )


if __name__ == "__main__":
    main()
