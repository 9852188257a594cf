"""The sampler: the whole batch on its device with one transfer to the host, draws that follow the distribution
asked for and are keyed by (seed, step), and a row without a valid distribution that fails alone."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from engine.core.sampling import sample
from engine.core.sampling_params import SamplingParams


GREEDY = SamplingParams(max_tokens=4)


def tokens(*args) -> list[int | None]:
    """The sampled ids alone."""
    return [s.token for s in sample(*args)]


def test_a_greedy_batch_is_picked_without_a_per_row_sync_and_a_bad_row_fails_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 512, generator=gen)
    logits[5, :] = float("nan")  # argmax of a NaN row lands on a NaN: no valid distribution
    logits[9, 7] = float("inf")  # an infinite winner is no distribution either
    expected = [int(r.argmax()) for r in logits]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        picked = tokens(logits, [GREEDY] * 32, [None] * 32, [0] * 32)
    assert picked == [None if i in (5, 9) else t for i, t in enumerate(expected)]
    scalar_syncs = sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")
    assert scalar_syncs == 0  # a per-row bool(isfinite(...)) made 32 of them: one device sync each on a GPU


def test_seeded_rows_beside_greedy_ones_keep_their_draws():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=11)
    mixed = tokens(logits, [GREEDY, seeded, GREEDY, seeded], [None, 11, None, 11], [0, 3, 0, 3])
    alone = tokens(logits[1:2], [seeded], [11], [3])
    assert mixed[0] == int(logits[0].argmax()) and mixed[2] == int(logits[2].argmax())
    assert mixed[1] == alone[0] and mixed[3] == int(tokens(logits[3:4], [seeded], [11], [3])[0])


def test_draws_follow_the_distribution_top_k_and_top_p_ask_for():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 3000

    def frequencies(params: SamplingParams) -> torch.Tensor:
        picked = tokens(logits.expand(n, -1).contiguous(), [params] * n, list(range(n)), [0] * n)
        return torch.bincount(torch.tensor(picked), minlength=6).double() / n

    plain = frequencies(SamplingParams(temperature=1.0))
    assert (plain - torch.softmax(logits[0].double(), 0)).abs().max() < 0.03
    top_k = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert top_k[2:].sum() == 0
    assert abs(top_k[0] - torch.softmax(logits[0, :2].double(), 0)[0]) < 0.03
    probs = torch.softmax(logits[0].double(), 0)  # 0.55, 0.20, 0.12, ...: a nucleus of 0.7 keeps the first two
    top_p = frequencies(SamplingParams(temperature=1.0, top_p=0.7))
    assert top_p[2:].sum() == 0 and abs(top_p[0] - probs[0] / probs[:2].sum()) < 0.03


def test_a_sampled_batch_reads_the_host_once_and_a_seed_draws_the_same_token_at_every_step_it_is_asked():
    logits = torch.randn(32, 512, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(max_tokens=4, temperature=0.9, top_k=50, top_p=0.8, seed=i) for i in range(32)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        first = tokens(logits, params, list(range(32)), [7] * 32)
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") == 0
    assert first == tokens(logits, params, list(range(32)), [7] * 32)  # keyed by (seed, step): a migration redraws it
    assert first != tokens(logits, params, list(range(32)), [8] * 32)  # and the next step draws anew


def test_logprobs_are_those_of_the_distribution_drawn_from_and_come_in_the_one_transfer():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    bias = {7: 5.0, 11: -100.0}
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(temperature=0.5, seed=1, logprobs=0),
              SamplingParams(logprobs=5, logit_bias=bias)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = sample(logits, params, [None, None, 1, None], [0, 0, 2, 0])
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense") == 0
    assert out[1].logprob is None  # not asked for
    want = torch.log_softmax(logits[0].double(), 0)
    assert abs(out[0].logprob.logprob - want[out[0].token]) < 1e-5 and out[0].token == int(want.argmax())
    top = torch.topk(want, 3)
    assert [t for t, _ in out[0].logprob.top] == top.indices.tolist()
    assert max(abs(v - w) for (_, v), w in zip(out[0].logprob.top, top.values.tolist())) < 1e-5
    drawn = torch.log_softmax(logits[2].double() / 0.5, 0)  # a sampled row: at its temperature
    assert out[2].logprob.top == [] and abs(out[2].logprob.logprob - drawn[out[2].token]) < 1e-5
    biased = logits[3].double().clone()
    biased[7] += 5.0
    biased[11] -= 100.0
    want = torch.log_softmax(biased, 0)
    assert out[3].token == int(biased.argmax()) and abs(out[3].logprob.logprob - want[out[3].token]) < 1e-5
    assert [t for t, _ in out[3].logprob.top] == torch.topk(want, 5).indices.tolist()


def test_a_logit_bias_moves_its_own_row_only():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    worst = int(logits[1].argmin())
    banned = {int(t): -100.0 for t in range(64) if t != worst}  # every token but the least likely
    params = [GREEDY, SamplingParams(logit_bias=banned), SamplingParams(temperature=1.0, seed=3, logit_bias=banned)]
    picked = tokens(logits, params, [None, None, 3], [0, 0, 0])
    assert picked == [int(logits[0].argmax()), worst, worst]
    assert tokens(logits[:1], [SamplingParams(logit_bias={63: 100.0})], [None], [0]) == [63]
