"""Per-layer expert load: tokens routed to each logical expert over a sliding window of steps.

The window feeds EPLB; the totals and window sums are exported as prometheus metrics on the
registry the caller passes in (one registry per process, owned by the server).
"""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge


class ExpertLoadStats:
    """Counts routed (token, expert) pairs per MoE layer; `end_step` closes a step into the window."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int, registry: CollectorRegistry | None = None) -> None:
        if window_steps <= 0:
            raise ValueError(f"window_steps must be positive, got {window_steps}")
        self.num_layers, self.num_experts, self.window_steps = num_layers, num_experts, window_steps
        self._window = torch.zeros(window_steps, num_layers, num_experts, dtype=torch.int64)
        self._current = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self._slot = 0
        self._gauge = self._counter = self._imbalance = None
        if registry is not None:
            labels = ["layer", "expert"]
            self._gauge = Gauge("tideflow_expert_window_tokens", "tokens routed to the expert over the sliding window",
                                labels, registry=registry)
            self._counter = Counter("tideflow_expert_routed_tokens", "tokens routed to the expert since start",
                                    labels, registry=registry)
            self._imbalance = Gauge("tideflow_expert_window_imbalance",
                                    "max/mean tokens per expert over the window (1.0 is balanced)", ["layer"],
                                    registry=registry)

    def observe(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add one forward's routing of MoE layer `layer` (logical expert ids [T, k])."""
        self._current[layer] += torch.bincount(topk_ids.reshape(-1).cpu(), minlength=self.num_experts)

    def end_step(self) -> None:
        """Move the current step's counts into the window (evicting the oldest) and update metrics."""
        step = self._current
        self._window[self._slot] = step
        self._slot = (self._slot + 1) % self.window_steps
        self._current = torch.zeros_like(step)
        if self._gauge is None:
            return
        window = self.window_load()
        for layer in range(self.num_layers):
            for expert in range(self.num_experts):
                labels = (str(layer), str(expert))
                self._gauge.labels(*labels).set(int(window[layer, expert]))
                if step[layer, expert]:
                    self._counter.labels(*labels).inc(int(step[layer, expert]))
            mean = window[layer].float().mean()
            self._imbalance.labels(str(layer)).set(float(window[layer].max() / mean) if mean > 0 else 1.0)

    def window_load(self) -> torch.Tensor:
        """[layers, experts] tokens over the last `window_steps` closed steps."""
        return self._window.sum(0)
