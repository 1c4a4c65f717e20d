"""Flower records <-> plain arrays (kept apart from schema.py so that strategies, which
import the schema, never import Flower)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedstale.common.schema import (
    ARRAYS,
    COHORT,
    COHORT_SIZE,
    CONFIG,
    METRICS,
    set_key,
    set_name,
)

ArraySets = Mapping[str, Mapping[str, np.ndarray]]  # set name -> state-dict-like arrays


def frozen_copy(
    arrays: Mapping[str, np.ndarray] | None, sets: ArraySets | None
) -> tuple[dict[str, np.ndarray] | None, dict[str, dict[str, np.ndarray]] | None]:
    """A task's arrays as they are when it is sent: a rule may change its own arrays in place
    afterwards (PACE blends phi_c), and a task trained later must not see that."""
    kept = None if arrays is None else {name: np.array(a, copy=True) for name, a in arrays.items()}
    kept_sets = None
    if sets is not None:
        kept_sets = {
            key: {name: np.array(a, copy=True) for name, a in part.items()}
            for key, part in sets.items()
        }
    return kept, kept_sets


def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def flat(arrays: Mapping[str, np.ndarray], names: list[str]) -> np.ndarray:
    """`arrays` in the order `names`, as one float64 vector (a client's delta is computed
    in it)."""
    return np.concatenate([np.asarray(arrays[n], np.float64).ravel() for n in names])


def message_content(
    config: Mapping[str, Any] | None,
    arrays: Mapping[str, np.ndarray] | None = None,
    sets: ArraySets | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> RecordDict:
    """A RecordDict of the schema's records; both directions use it."""
    content = RecordDict()
    if config is not None:
        content[CONFIG] = ConfigRecord(dict(config))
    if metrics is not None:
        content[METRICS] = MetricRecord(dict(metrics))
    if arrays is not None:
        content[ARRAYS] = to_array_record(arrays)
    for name, values in (sets or {}).items():
        content[set_key(name)] = to_array_record(values)
    return content


def decode_sets(content: RecordDict) -> dict[str, dict[str, np.ndarray]]:
    """The extra named array sets of a message; raises ValueError/TypeError if malformed."""
    sets = {}
    for key in content:
        name = set_name(key)
        if name is None:
            continue
        record = content[key]
        if not isinstance(record, ArrayRecord):
            raise TypeError(f"'{key}' is not an ArrayRecord")
        sets[name] = from_array_record(record)
    return sets


def cohort_content(parts: list[RecordDict]) -> RecordDict:
    """Several tasks' (or replies') contents in one message: part i's records under keys
    "i/<key>", and their count in the ConfigRecord COHORT."""
    content = RecordDict()
    content[COHORT] = ConfigRecord({COHORT_SIZE: len(parts)})
    for index, part in enumerate(parts):
        for key, record in part.items():
            content[f"{index}/{key}"] = record
    return content


def cohort_parts(content: RecordDict) -> list[RecordDict] | None:
    """The parts of a cohort message in order, or None when `content` is not one; raises
    ValueError when its keys do not match its count."""
    header = content.get(COHORT)
    if not isinstance(header, ConfigRecord):
        return None
    size = header.get(COHORT_SIZE)
    if not isinstance(size, int) or size < 0:
        raise ValueError(f"a cohort message's size is {size!r}, not a count")
    parts = [RecordDict() for _ in range(size)]
    for key in content:
        if key == COHORT:
            continue
        index, _, inner = key.partition("/")
        if not index.isdigit() or int(index) >= size or not inner:
            raise ValueError(f"a cohort message of {size} parts holds the record '{key}'")
        parts[int(index)][inner] = content[key]
    return parts
