"""The run's model: built from the run config and the dataset's shape, the same weights
on the server and on every client."""

from __future__ import annotations

import json
from functools import cache

import torch

from fedstale.common.config import ClientSettings
from fedstale.common.data import load_dataset
from fedstale.common.models import build_model, resolve_device
from fedstale.common.shares import cached_file, store

Shape = tuple[tuple[int, ...], int]


@cache
def dataset_shape(dataset: str, data_dir: str) -> Shape:
    """(one sample's shape, the number of classes or outputs) of a dataset, read from the
    dataset; a built-in dataset's is remembered on disk beside the shares, so that a fresh
    ClientApp process does not load the whole dataset for it."""
    remembered = cached_file(dataset, (dataset, data_dir), "shape.json")
    if remembered is not None and remembered.is_file():
        try:
            shape, classes = json.loads(remembered.read_text())
            return tuple(int(v) for v in shape), int(classes)
        except (OSError, ValueError, TypeError):
            pass  # damaged: read from the dataset below
    data = load_dataset(dataset, data_dir)
    found = (tuple(int(v) for v in data.input_shape), int(data.num_classes))
    if remembered is not None:
        text = json.dumps([list(found[0]), found[1]]).encode()
        store(remembered, lambda handle: handle.write(text))
    return found


def data_shape(cfg: ClientSettings) -> Shape:
    """(input shape, number of classes) of the run's dataset."""
    return dataset_shape(cfg.dataset, cfg.data_dir)


def run_model(cfg: ClientSettings) -> torch.nn.Module:
    """The run's model, freshly initialised from its seed, on its device: the same weights
    on the server and on every client."""
    input_shape, num_classes = data_shape(cfg)
    model = build_model(cfg.model_name, input_shape, num_classes, cfg.seed)
    return model.to(resolve_device(cfg.device))
