"""Flower's output reaches the user through fedstale run, less warnings about a setting
fedstale chose (Flower 1.32+ warns of its default SuperNode count in every simulation)."""

from __future__ import annotations

import pytest

from fedstale.launcher.relay import Relayed

SCRIPT = (
    "echo 'INFO :      Starting simulation'; "
    "echo 'WARNING :   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.'; "
    "echo 'INFO :      Federation `local` (6 simulated SuperNodes)'; "
    "echo 'INFO :      To change federation size, use the following command:'; "
    "printf 'INFO :  \\tflwr federation simulation-config x <link> --num-supernodes <N>\\n'; "
    "echo 'an error line' >&2; exit 3"
)


def test_flowers_lines_pass_in_order_on_their_own_stream_less_the_ones_fedstale_settled(
    capfd: pytest.CaptureFixture[str],
) -> None:
    relayed = Relayed(["sh", "-c", SCRIPT], {"PATH": "/usr/bin:/bin"})
    assert relayed.process.wait(10) == 3
    relayed.finish()
    out, err = capfd.readouterr()
    assert out.splitlines() == [
        "INFO :      Starting simulation",
        "INFO :      Federation `local` (6 simulated SuperNodes)",
    ]
    assert err == "an error line\n"
