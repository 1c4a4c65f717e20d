"""Staleness functions s(tau), shared by every rule that discounts stale work.

constant: 1; poly: (tau + 1)^-a; hinge: 1 if tau <= b else 1 / (a (tau - b) + 1);
exponential: exp(-a tau). FedAsync (Xie et al. 2019, Sec. 5.2) defines the first three;
FedBuff uses poly with a = 0.5; PACE's decay (eq. 10) is poly with its own a.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Kind = Literal["constant", "poly", "hinge", "exponential"]
KINDS: tuple[str, ...] = ("constant", "poly", "hinge", "exponential")


@dataclass(frozen=True)
class Staleness:
    kind: str = "poly"
    a: float = 0.5
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown staleness function '{self.kind}'; choose one of {KINDS}")

    def __call__(self, tau: int) -> float:
        if self.kind == "constant":
            return 1.0
        if self.kind == "poly":
            return float((tau + 1.0) ** -self.a)
        if self.kind == "hinge":
            return 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)
        return math.exp(-self.a * tau)
