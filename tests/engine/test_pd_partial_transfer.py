"""Prefill -> decode with a decode worker that already holds the prompt's first blocks: only the rest travels, the
answer is the colocated engine's, and a held prefix that was evicted meanwhile is recomputed, never answered wrong."""

from __future__ import annotations

import queue
import random
import time

import pytest

from engine.core.engine_config import EngineConfig
from engine.core.block_hash import chain_hashes
from engine.core.kv_cache import kv_nbytes
from engine.core.llm_engine import LLMEngine
from engine.core.pd import Handoff
from engine.core.pd_messages import HandoffResult, new_transfer_id
from engine.core.sampling_params import SamplingParams
from engine.router.kv_index import KVIndex
from engine.transfer import ShmReceiver, ShmSender

BLOCK = 16
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """A prefill engine, a decode engine and a colocated one for the reference answers."""
    started = [LLMEngine.from_dir(tiny_model_dir, EngineConfig(block_size=BLOCK, kv_cache_bytes=4 << 20))
               for _ in range(3)]
    for engine in started:
        engine.start()
    yield started
    for engine in started:
        engine.stop()


def _prefill(engine: LLMEngine, sender: ShmSender, prompt: list[int], skip: int) -> HandoffResult:
    outputs: queue.Queue = queue.Queue()
    engine.submit(prompt, PARAMS, outputs.put, handoff=Handoff(sender, new_transfer_id(), skip))
    while True:
        out = outputs.get(timeout=60)
        assert out.error is None, out.error
        if out.handoff is not None:
            return out.handoff


def _decode(engine: LLMEngine, receiver: ShmReceiver, prompt: list[int], handoff: HandoffResult) -> tuple[list[int], int]:
    """The answer's tokens and how many KV bytes decode pulled."""
    kv = receiver.fetch(handoff.descriptor, 10)
    nbytes = kv.nbytes

    def release() -> None:
        kv.release()
        receiver.release(handoff.descriptor)

    outputs: queue.Queue = queue.Queue()
    engine.submit_prefilled(prompt, PARAMS, handoff, kv, release, outputs.put)
    tokens = []
    while True:
        out = outputs.get(timeout=60)
        assert out.error is None, out.error
        tokens += out.token_ids
        if out.finished:
            return tokens, nbytes


def _held_run(engine: LLMEngine, prompt: list[int]) -> int:
    """The leading blocks of `prompt` the engine's feed says it holds, read as the router reads them."""
    index = KVIndex()
    index.apply("decode", engine.kv_event_page("", 0).model_dump())
    hashes = chain_hashes(prompt, BLOCK, {}, None, 0, len(prompt) // BLOCK)
    return index.device_run("decode", hashes, within_s=60, now=time.monotonic())


def test_a_decode_worker_holding_the_prefix_is_sent_only_the_rest(engines):
    prefill, decode, colocated = engines
    sender, receiver = ShmSender(), ShmReceiver()
    rng = random.Random(5)
    system = [rng.randrange(3, 500) for _ in range(5 * BLOCK)]
    first, second = system + [7, 8, 9], system + [rng.randrange(3, 500) for _ in range(2 * BLOCK + 3)]
    want = [r.token_ids for r in colocated.generate([first, second], PARAMS)]

    assert _held_run(decode, first) == 0
    handoff = _prefill(prefill, sender, first, 0)
    got, whole = _decode(decode, receiver, first, handoff)
    assert got == want[0] and handoff.skipped_blocks == 0

    skip = _held_run(decode, second)
    assert skip == 5  # the system prompt's blocks, named by the decode worker's feed
    handoff = _prefill(prefill, sender, second, skip)
    got, part = _decode(decode, receiver, second, handoff)
    assert got == want[1]
    assert handoff.skipped_blocks == skip
    per_block = kv_nbytes(decode.runner.kv_cache, 1)
    assert part == per_block * (-(-len(second) // BLOCK) - skip)
    assert whole == per_block * -(-len(first) // BLOCK)
    assert decode.metrics.value("tideflow_kv_transfer_skipped_blocks_total") == skip


def test_a_skipped_prefix_evicted_before_the_import_is_recomputed(engines):
    prefill, decode, colocated = engines
    sender, receiver = ShmSender(), ShmReceiver()
    rng = random.Random(11)
    prompt = [rng.randrange(3, 500) for _ in range(4 * BLOCK + 5)]
    want = colocated.generate([prompt], PARAMS)[0].token_ids
    before = decode.metrics.value("tideflow_kv_transfer_recomputes_total")

    assert _held_run(decode, prompt) == 0  # the router would skip nothing: we claim 3 held blocks all the same
    handoff = _prefill(prefill, sender, prompt, 3)
    assert handoff.skipped_blocks == 3
    got, _ = _decode(decode, receiver, prompt, handoff)
    assert got == want
    assert decode.metrics.value("tideflow_kv_transfer_recomputes_total") == before + 1


def test_at_least_the_last_block_always_travels(engines):
    prefill, decode, colocated = engines
    sender, receiver = ShmSender(), ShmReceiver()
    prompt = [(13 * i) % 400 + 3 for i in range(3 * BLOCK)]  # three full blocks, nothing after them
    want = colocated.generate([prompt], PARAMS)[0].token_ids
    handoff = _prefill(prefill, sender, prompt, 0)
    assert _decode(decode, receiver, prompt, handoff)[0] == want
    handoff = _prefill(prefill, sender, prompt, 99)
    assert handoff.skipped_blocks == 2
    got, nbytes = _decode(decode, receiver, prompt, handoff)
    assert got == want and nbytes == kv_nbytes(decode.runner.kv_cache, 1)
