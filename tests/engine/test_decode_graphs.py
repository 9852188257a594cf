"""Decode through static, padded buffers (what CUDA graphs replay), checked on the CPU: the bucket each batch takes,
the steps that stay eager, and an engine whose decode steps all go through the padded buffers answering token for
token as the plain engine does, with every KV block a sequence owns identical (a padded row writes only the
scratch block). The replay itself needs a GPU (scripts/gpu_bench.py)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.decode_graphs import DecodeGraphs, bucket_for, decode_graphs_for, graph_batches
from engine.core.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.model_runner import ModelRunner, SeqStep
from engine.core.sampling_params import SamplingParams
from engine.model.loader import load_model
from engine.model.tokenizer import Tokenizer

BLOCK = 16


def test_batches_are_the_standard_buckets_below_the_largest_batch_and_that_batch():
    assert graph_batches(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_batches(48) == (1, 2, 4, 8, 16, 32, 48)
    assert graph_batches(300) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)
    assert graph_batches(1) == (1,)
    batches = graph_batches(48)
    assert [bucket_for(n, batches) for n in (1, 3, 5, 17, 33, 48, 49)] == [1, 4, 8, 32, 48, 48, None]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_only_steps_of_single_tokens_within_the_buckets_take_the_buffers(model):
    graphs = DecodeGraphs(model, BLOCK, 4, capture=False)
    runner = ModelRunner(model, 8, BLOCK, graphs)
    assert runner.kv_cache[0][0].shape[0] == 9 and graphs.scratch == 8  # the allocator's 8 and a scratch block
    decode = SeqStep([5], 3, [0])
    assert graphs.covers([decode] * 4)
    assert not graphs.covers([decode] * 5)  # above the largest bucket
    assert not graphs.covers([decode, SeqStep([5, 6], 0, [1])])  # a prefill chunk in the step
    assert not graphs.covers([SeqStep([5], 3, [0], embeds=torch.zeros(1, model.config.hidden_size))])
    runner.release()
    assert not graphs.covers([decode])  # no KV cache bound
    runner.allocate(8)
    assert graphs.covers([decode])
    waiting = DecodeGraphs(model, BLOCK, 4, capture=True)  # a CUDA runner before (or after a failed) capture
    ModelRunner(model, 8, BLOCK, waiting)
    assert not waiting.covers([decode])


def test_off_cuda_or_with_enforce_eager_there_are_no_graphs(model):
    assert decode_graphs_for(model, EngineConfig(device="cpu")) is None
    assert decode_graphs_for(model, EngineConfig(device="cuda", enforce_eager=True)) is None


def test_decoding_through_padded_buffers_answers_as_the_eager_engine(tiny_model_dir, model):
    tok = Tokenizer(tiny_model_dir)
    config = EngineConfig(block_size=BLOCK, kv_cache_bytes=2 << 20, max_num_seqs=16, max_wait_ms=0)
    plain = LLMEngine(model, tok, config)
    graphs = DecodeGraphs(model, BLOCK, config.max_num_seqs, capture=False)
    padded = LLMEngine(model, tok, config, runner=ModelRunner(model, plain.runner.num_blocks, BLOCK, graphs))
    steps = []
    run = graphs.run
    graphs.run = lambda seqs: (steps.append(len(seqs)), run(seqs))[1]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(5, 60))] for _ in range(11)]
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(11)]
    for engine in (plain, padded):
        engine.start()
    try:
        want = [r.token_ids for r in plain.generate(prompts, params)]
        got = [r.token_ids for r in padded.generate(prompts, params)]
    finally:
        for engine in (plain, padded):
            engine.stop()
    assert got == want
    assert steps and any(bucket_for(n, graphs.batches) != n for n in steps), steps  # padded steps were taken
    blocks = plain.runner.num_blocks
    for (k, v), (pk, pv) in zip(plain.runner.kv_cache, padded.runner.kv_cache):
        assert torch.allclose(k, pk[:blocks], atol=1e-5) and torch.allclose(v, pv[:blocks], atol=1e-5)
