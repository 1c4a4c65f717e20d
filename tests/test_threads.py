"""Client work runs on `client-threads` torch and BLAS threads; the caller's come back."""

from types import SimpleNamespace

import torch
from threadpoolctl import threadpool_info, threadpool_limits

from fedstale.common.threads import blas_threads, limited, on_client_threads


def blas() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_limited_sets_both_and_restores() -> None:
    with threadpool_limits(2, user_api="blas"):
        torch_before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            with limited(1):
                assert torch.get_num_threads() == 1 and blas() == {1}
            assert torch.get_num_threads() == 2 and blas() == {2}
        finally:
            torch.set_num_threads(torch_before)


def test_zero_leaves_threads_alone() -> None:
    with blas_threads(2):
        torch_before = torch.get_num_threads()
        with limited(0):
            assert torch.get_num_threads() == torch_before and blas() == {2}


def test_client_work_sees_its_config() -> None:
    seen = []

    @on_client_threads
    def work(cfg: SimpleNamespace, extra: int) -> int:
        seen.append((torch.get_num_threads(), blas()))
        return extra

    with blas_threads(2):
        assert work(SimpleNamespace(client_threads=1), 7) == 7
        assert blas() == {2}
    assert seen == [(1, {1})]
