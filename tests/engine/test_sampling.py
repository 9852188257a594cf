"""The sampler's greedy path: one transfer to the host for the whole batch, and a row without a valid
distribution fails alone."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from engine.sampling import SamplingParams, sample

GREEDY = SamplingParams(max_tokens=4)


def test_a_greedy_batch_is_picked_without_a_per_row_sync_and_a_bad_row_fails_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 512, generator=gen)
    logits[5, :] = float("nan")  # argmax of a NaN row lands on a NaN: no valid distribution
    logits[9, 7] = float("inf")  # an infinite winner is no distribution either
    expected = [int(r.argmax()) for r in logits]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        picked = sample(logits, [GREEDY] * 32, [None] * 32, [0] * 32)
    assert picked == [None if i in (5, 9) else t for i, t in enumerate(expected)]
    scalar_syncs = sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")
    assert scalar_syncs == 0  # a per-row bool(isfinite(...)) made 32 of them: one device sync each on a GPU


def test_seeded_rows_beside_greedy_ones_keep_their_draws():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=11)
    mixed = sample(logits, [GREEDY, seeded, GREEDY, seeded], [None, 11, None, 11], [0, 3, 0, 3])
    alone = sample(logits[1:2], [seeded], [11], [3])
    assert mixed[0] == int(logits[0].argmax()) and mixed[2] == int(logits[2].argmax())
    assert mixed[1] == alone[0] and mixed[3] == int(sample(logits[3:4], [seeded], [11], [3])[0])
