"""Is this step's update safe to apply? NaN/Inf and loss or gradient-norm spikes.

A spike is a value above mean + k*std of the last `window` accepted steps (PaLM restarted from
a checkpoint before such spikes and skipped the batches around them). Detection starts once the
window is full, so the steep first steps of training are never mistaken for spikes; std is
floored at 1% of the mean so that a very flat curve does not turn noise into spikes. Values of a
rejected step never enter the window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Anomaly:
    kind: str  # "nan", "loss_spike" or "grad_spike"
    step: int
    value: float
    threshold: float

    def describe(self) -> str:
        if self.kind == "nan":
            return f"non-finite loss or grad norm ({self.value}) at step {self.step}"
        what = "loss" if self.kind == "loss_spike" else "grad norm"
        return f"{what} {self.value:.4g} above the spike threshold {self.threshold:.4g} at step {self.step}"


class SpikeDetector:
    def __init__(self, sigma: float, window: int) -> None:
        self.sigma, self.window = sigma, window
        self.history: deque[tuple[int, float, float]] = deque(maxlen=window)  # step, loss, grad norm

    def check(self, step: int, loss: float, grad_norm: float) -> Anomaly | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return Anomaly("nan", step, loss if not math.isfinite(loss) else grad_norm, math.nan)
        if self.sigma <= 0 or len(self.history) < self.window:
            return None
        for kind, index, value in (("loss_spike", 1, loss), ("grad_spike", 2, grad_norm)):
            values = [h[index] for h in self.history]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            threshold = mean + self.sigma * max(std, 0.01 * abs(mean))
            if value > threshold:
                return Anomaly(kind, step, value, threshold)
        return None

    def add(self, step: int, loss: float, grad_norm: float) -> None:
        self.history.append((step, loss, grad_norm))

    def forget_after(self, step: int) -> None:
        """After a rollback to `step`, the steps after it will run again: drop them."""
        kept = [h for h in self.history if h[0] <= step]
        self.history = deque(kept, maxlen=self.window)

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((tuple(h) for h in state.get("history", [])), maxlen=self.window)
