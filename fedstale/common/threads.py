"""How many threads torch and numpy's BLAS use, for the server's vector math and for a
client's work.

OpenBLAS splits one long dot product over every core. On a box whose cores are busy
training, that split made a 48,000-element dot 50 times slower (1.23 ms against 0.024 ms
on one thread, measured on the 2-core CI box), and FedQS takes such dots for every task
it sends. So the server's strategy math runs on one BLAS thread, and a client's work on
`client-threads` torch and BLAS threads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from threadpoolctl import ThreadpoolController

Work = TypeVar("Work", bound=Callable[..., Any])


@functools.cache
def controller() -> ThreadpoolController:
    return ThreadpoolController()


@contextmanager
def blas_threads(threads: int) -> Iterator[None]:
    """numpy's BLAS on `threads` threads inside the block."""
    with controller().limit(limits=threads, user_api="blas"):
        yield


@contextmanager
def limited(threads: int) -> Iterator[None]:
    """torch and BLAS on `threads` threads inside the block (0: as they are)."""
    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with blas_threads(threads):
            yield
    finally:
        torch.set_num_threads(before)


def on_client_threads(work: Work) -> Work:
    """`work(cfg, ...)` run on `cfg.client_threads` torch and BLAS threads."""

    @functools.wraps(work)
    def run(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        with limited(cfg.client_threads):
            return work(cfg, *args, **kwargs)

    return run  # type: ignore[return-value]
