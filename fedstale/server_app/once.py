"""A failure that repeats logged once: a dead node fails every message sent to it the same
way, and each evaluation would otherwise log that again. The first line per key (a node
and a cause) is a warning; repeats go to debug, and `repeats` counts them."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable
from typing import Any


class OnceLog:
    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.seen: Counter[Hashable] = Counter()

    def warning(self, key: Hashable, message: str, *args: Any) -> None:
        """`message % args` at warning level the first time `key` is seen, else at debug."""
        self.seen[key] += 1
        level = logging.WARNING if self.seen[key] == 1 else logging.DEBUG
        self.logger.log(level, message, *args)

    @property
    def repeats(self) -> int:
        """How many lines went to debug as repeats."""
        return sum(count - 1 for count in self.seen.values())
