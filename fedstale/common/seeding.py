"""Seeds derived from (run seed, client, task) so that every draw is replayable."""

from __future__ import annotations

import numpy as np


def task_seed(run_seed: int, client: int, task_id: int) -> int:
    """A 31-bit seed unique to one task of one client in one run."""
    state = np.random.SeedSequence([run_seed, client, task_id]).generate_state(1)
    return int(state[0] & 0x7FFFFFFF)
