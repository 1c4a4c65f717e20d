"""Buffer-then-flush, the step every buffered rule shares (FedBuff, CA2FL, FedPSA, the
K-FIFO of SAFL and FedQS): arrivals collect until K are in; then the K are handed over
once and the buffer starts empty again."""

from __future__ import annotations

from typing import Generic, TypeVar

from pydantic import Field

from fedstale.common.config import KebabModel

Item = TypeVar("Item")


class BufferParams(KebabModel):
    """The key every buffered rule declares: K, the updates one flush (or window) holds.
    One key for all of them, so that a grid compares the rules at the same K."""

    buffer_size: int = Field(default=5, ge=1)


class Buffer(Generic[Item]):
    def __init__(self, size: int) -> None:
        self.size = size
        self.items: list[Item] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Item) -> list[Item] | None:
        """Keep `item`; the full batch, in arrival order, when it makes K (else None)."""
        self.items.append(item)
        if len(self.items) < self.size:
            return None
        batch, self.items = self.items, []
        return batch
