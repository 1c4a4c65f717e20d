"""Where each parameter of a model sits in one flat float32 vector: numpy only, so that the
server's bookkeeping and the launcher can use it without importing torch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes and offsets of a model's parameters inside one flat float32 vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: nn.Module) -> ParamLayout:
        state = model.state_dict()
        return cls(tuple(state), tuple(tuple(t.shape) for t in state.values()))

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(shape)) for shape in self.shapes]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def flatten(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray(arrays[n], np.float32).ravel() for n in self.names])

    @property
    def segments(self) -> list[tuple[int, int]]:
        """(start, stop) of each parameter tensor in the flat vector, in layout order."""
        ends = np.cumsum([0, *self.sizes])
        return [(int(a), int(b)) for a, b in itertools.pairwise(ends)]

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {
            name: flat[start:stop].reshape(shape)
            for name, shape, (start, stop) in zip(
                self.names, self.shapes, self.segments, strict=True
            )
        }
