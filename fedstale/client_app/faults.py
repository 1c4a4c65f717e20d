"""Deliberate misbehaviour for tests (run-config `test-faults`, never set in production):
the client corrupts the reply of chosen tasks so that the server's validation is exercised
over a real Flower transport."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedstale.common.schema import ReplyKeys
from fedstale.strategies.fedpsa import FedPSAKeys

OVERSIZED_FLOATS = 4_000_000  # 16 MB of padding beside the model's arrays


Arrays = dict[str, np.ndarray]


def corrupt(
    kind: str, metrics: dict[str, Any], arrays: Arrays, sets: dict[str, Arrays]
) -> tuple[dict[str, Any], Arrays, dict[str, Arrays]]:
    """Return (metrics, arrays, named sets) damaged as `kind` says."""
    metrics, arrays = dict(metrics), {k: v.copy() for k, v in arrays.items()}
    sets = dict(sets)
    first = next(iter(arrays))
    if kind in ("nan", "inf"):
        arrays[first].flat[0] = np.nan if kind == "nan" else np.inf
    elif kind == "shape":
        arrays[first] = arrays[first].ravel()[:-1].copy()
    elif kind == "dtype":
        arrays[first] = arrays[first].astype(np.float64)
    elif kind == "unknown-task":
        metrics[ReplyKeys.TASK_ID] = 10**9
    elif kind == "replay":
        metrics[ReplyKeys.TASK_ID] = max(0, int(metrics[ReplyKeys.TASK_ID]) - 1)
    elif kind == "no-metric":
        del metrics[ReplyKeys.NUM_EXAMPLES]
    elif kind == "bad-metric":
        metrics[ReplyKeys.NUM_EXAMPLES] = -5
    elif kind == "mistyped-metric":
        metrics[ReplyKeys.NUM_EXAMPLES] = float(metrics[ReplyKeys.NUM_EXAMPLES]) + 0.5
    elif kind == "sketch-length":
        metrics[FedPSAKeys.SKETCH] = list(metrics.get(FedPSAKeys.SKETCH, [0.0, 0.0]))[:-1]
    elif kind == "oversized":
        arrays["padding"] = np.ones(OVERSIZED_FLOATS, dtype=np.float32)
    elif kind == "extra-set":
        sets["unasked"] = arrays
    elif kind == "missing-set":
        sets.pop(next(iter(sets), ""), None)
    return metrics, arrays, sets
