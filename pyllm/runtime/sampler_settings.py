"""What the sampler is asked to do: its settings, their defaults and their checks (no torch or numpy here, so the
command line can parse and check sampling flags before anything heavy is imported)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import PyllmError


@dataclass
class SamplerSettings:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: dict = field(default_factory=dict)
    seed: int | None = None

    def validate(self) -> None:
        checks = [
            ("temperature", self.temperature >= 0 and math.isfinite(self.temperature), ">= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p < 1.0, "in [0, 1)"),
            ("typical_p", 0.0 < self.typical_p <= 1.0, "in (0, 1]"),
            ("repeat_penalty", self.repeat_penalty > 0, "> 0"),
            ("penalty_last_n", self.penalty_last_n >= 0, ">= 0"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise PyllmError(f"sampler setting {name}={getattr(self, name)!r} must be {want}")
