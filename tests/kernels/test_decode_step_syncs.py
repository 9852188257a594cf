"""A decode step of the engine, on the compiled CPU ops it serves with, brings data to the host once: the sampled
ids and their validity, for the whole batch (issue #36). On a GPU each `.item()`, `bool(tensor)` or `.tolist()`
is a host sync that stalls the launch queue; on the CPU the same calls show up in the profiler, so the count is
checked here."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine.core.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from tideflow_kernels import ops

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

STREAMS = 32


@pytest.fixture
def compiled_ops(cpu_build):
    _, impls = cpu_build
    for name, fn in impls.items():
        ops.use_compiled(name, fn, "cpu")
    assert sorted(impls) == sorted(ops.OP_NAMES)  # every op of the step is the compiled one
    yield


def test_a_32_stream_decode_step_syncs_with_the_host_at_most_once(compiled_ops, tiny_model_dir, monkeypatch):
    # one shuttle carries all 32 arrivals (no lone first departure), so every step after the prefill decodes all 32
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=STREAMS, max_wait_ms=1000, lone_arrival_ms=0)
    engine = LLMEngine.from_dir(tiny_model_dir, config)
    host_reads = []
    real_tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        host_reads.append(tensor.shape)
        return real_tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    steps = []  # (scalar reads, tolist reads, dispatched aten ops) of each all-decode step of STREAMS sequences
    run = engine._run

    def profiled(plan):
        if len(plan.batch) != STREAMS or any(item.num_new != 1 for item in plan.batch):
            return run(plan)
        host_reads.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(plan)
        events = prof.key_averages()
        scalars = sum(e.count for e in events if e.key == "aten::_local_scalar_dense")
        steps.append((scalars, len(host_reads), sum(e.count for e in events if e.key.startswith("aten::"))))

    engine._run = profiled
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    drawn = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=40, top_p=0.9, seed=5)
    engine.start()
    try:
        results = engine.generate([[i + 1, 7, 9] for i in range(STREAMS)], [greedy, drawn] * (STREAMS // 2))
    finally:
        engine.stop()
    assert all(len(r.token_ids) == 6 for r in results)
    assert len(steps) == 5  # the prefill step gives token 1, five decode steps the rest
    print(f"\n{STREAMS}-stream decode step (tiny model, half greedy, half top-k/top-p): "
          f"(scalar reads, tolist reads, aten ops) per step = {steps}")
    for scalars, reads, _ in steps:
        assert scalars + reads <= 1, steps
