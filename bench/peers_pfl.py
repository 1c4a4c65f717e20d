"""pfl-research's side of `python -m bench.peers`: run in pfl's own virtualenv (one process,
or one per rank under `torchrun`), never imported by fedstale.

    python bench/peers_pfl.py PROTOCOL_DIR OUT_JSON

Written after pfl's own `benchmarks/image_classification/pytorch/train.py`: a
`SimulatedBackend` over a `FederatedDataset` of the clients' slices (users sampled at
random, as there), `FederatedAveraging` with the central optimiser SGD at learning rate 1.0
on the averaged model difference (so the new model is the weighted mean of the clients'),
updates weighted by their datapoints, local SGD at the protocol's learning rate, epochs and
batch size, and one central evaluation after the last iteration. The data, the partition
and the initial weights are fedstale's, written by bench.peers to PROTOCOL_DIR
(protocol.json, data.npz); the model is built by fedstale's own `build_model`, the one
module fedstale imports here, so both sides train the same architecture from the same
weights. Each process trains on one thread. The rate is the clients' updates over the
seconds of `algorithm.run` (set-up and the final accuracy's extra pass excluded); rank 0
writes OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def main(protocol_dir: Path, out: Path) -> None:
    torch.set_num_threads(1)
    protocol = json.loads((protocol_dir / "protocol.json").read_text())
    with np.load(protocol_dir / "data.npz") as data:
        arrays = {name: data[name] for name in data.files}
    np.random.seed(protocol["seed"])
    torch.manual_seed(protocol["seed"])

    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.pytorch_ops import get_default_device
    from pfl.model.pytorch import PyTorchModel

    clients = protocol["num_clients"]
    slices = [
        (torch.from_numpy(arrays[f"x{c}"]), torch.from_numpy(arrays[f"y{c}"]))
        for c in range(clients)
    ]
    train = FederatedDataset.from_slices(slices, get_user_sampler("random", list(range(clients))))
    x_test, y_test = torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"])
    module = Classifier(fedstale_model(protocol)).to(get_default_device())
    params = [p for p in module.parameters() if p.requires_grad]
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(params, 1.0),
    )
    backend = SimulatedBackend(
        training_data=train, val_data=None, postprocessors=[WeightByDatapoints()]
    )
    iterations = protocol["updates"] // protocol["cohort"]
    eval_params = NNEvalHyperParams(local_batch_size=protocol["eval_batch_size"])
    evaluation = CentralEvaluationCallback(
        Dataset(raw_data=[x_test, y_test]), model_eval_params=eval_params, frequency=iterations
    )
    started = time.perf_counter()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=iterations,
            evaluation_frequency=iterations,
            train_cohort_size=protocol["cohort"],
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=protocol["lr"],
            local_num_epochs=protocol["epochs"],
            local_batch_size=protocol["batch_size"],
        ),
        model_eval_params=eval_params,
        callbacks=[evaluation],
    )
    seconds = time.perf_counter() - started
    if rank() == 0:
        result = {
            "updates": iterations * protocol["cohort"],
            "seconds": seconds,
            "updates_per_second": iterations * protocol["cohort"] / seconds,
            "accuracy": accuracy(module, x_test, y_test, protocol["eval_batch_size"]),
            "pfl_version": version("pfl"),
            "torch_version": torch.__version__,
        }
        out.write_text(json.dumps(result) + "\n")


def fedstale_model(protocol: dict) -> torch.nn.Module:
    sys.path.insert(0, str(ROOT))
    from fedstale.common.models import build_model

    shape, classes = tuple(protocol["input_shape"]), protocol["num_classes"]
    return build_model(protocol["model"], shape, classes, protocol["seed"])


class Classifier(torch.nn.Module):
    """The model as pfl's PyTorchModel wants it: `loss` and `metrics` beside `forward`."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> dict:
        from pfl.metrics import Weighted

        logits = self(x)
        summed = float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct = float((logits.argmax(1) == y).sum())
        return {"loss": Weighted(summed, len(y)), "accuracy": Weighted(correct, len(y))}


@torch.no_grad()
def accuracy(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    module.eval()
    correct = sum(
        int((module(xb).argmax(1) == yb).sum())
        for xb, yb in zip(x.split(batch), y.split(batch), strict=True)
    )
    return correct / len(y)


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def version(package: str) -> str:
    from importlib.metadata import version as installed

    return installed(package)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
