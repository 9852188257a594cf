"""Sliding-window expert load and its prometheus series."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from engine.parallel.expert_load import ExpertLoadStats


def test_window_slides_and_metrics_export():
    registry = CollectorRegistry()
    stats = ExpertLoadStats(num_layers=2, num_experts=4, window_steps=2, registry=registry)
    for step_ids in ([[0, 1], [0, 2]], [[3, 3]], [[1, 1]]):
        stats.observe(0, torch.tensor(step_ids))
        stats.observe(1, torch.tensor([[2, 0]]))
        stats.end_step()
    assert stats.window_load()[0].tolist() == [0, 2, 0, 2]
    assert stats.window_load()[1].tolist() == [2, 0, 2, 0]
    text = generate_latest(registry).decode()
    assert 'tideflow_expert_window_tokens{expert="3",layer="0"} 2.0' in text
    assert 'tideflow_expert_routed_tokens_total{expert="0",layer="0"} 2.0' in text
    assert 'tideflow_expert_window_imbalance{layer="1"} 2.0' in text


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window_steps"):
        ExpertLoadStats(1, 4, 0)
