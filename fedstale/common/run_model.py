"""The run's model: built from the run config and the dataset's shape, the same weights
on the server and on every client."""

from __future__ import annotations

import hashlib
import json
from functools import cache

import torch

from fedstale.common.config import RunConfig, is_reference
from fedstale.common.data import load_dataset
from fedstale.common.files import write_atomically
from fedstale.common.models import build_model, resolve_device
from fedstale.common.shares import CACHE_FORMAT, cache_dir

Shape = tuple[tuple[int, ...], int]


@cache
def dataset_shape(dataset: str, data_dir: str) -> Shape:
    """(one sample's shape, the number of classes or outputs) of a dataset, read from the
    dataset; a built-in dataset's is remembered on disk beside the shares, so that a fresh
    ClientApp process does not load the whole dataset for it."""
    path = cache_dir()
    remembered = None
    if path is not None and not is_reference(dataset):
        key = repr((CACHE_FORMAT, dataset, data_dir)).encode()
        remembered = path / f"shape-{hashlib.sha256(key).hexdigest()[:20]}.json"
        try:
            shape, classes = json.loads(remembered.read_text())
            return tuple(int(v) for v in shape), int(classes)
        except (OSError, ValueError, TypeError):
            pass  # not remembered yet, or damaged: read from the dataset below
    data = load_dataset(dataset, data_dir)
    found = (tuple(int(v) for v in data.input_shape), int(data.num_classes))
    if remembered is not None:
        try:
            remembered.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps([list(found[0]), found[1]])
            write_atomically(remembered, lambda handle: handle.write(text.encode()))
        except OSError:
            pass  # a read-only home only costs speed
    return found


def data_shape(cfg: RunConfig) -> Shape:
    """(input shape, number of classes) of the run's dataset."""
    return dataset_shape(cfg.dataset, cfg.data_dir)


def run_model(cfg: RunConfig) -> torch.nn.Module:
    """The run's model, freshly initialised from its seed, on its device: the same weights
    on the server and on every client."""
    input_shape, num_classes = data_shape(cfg)
    model = build_model(cfg.model_name, input_shape, num_classes, cfg.seed)
    return model.to(resolve_device(cfg.device))
