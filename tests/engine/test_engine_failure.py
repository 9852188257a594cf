"""An engine thread that ends on an error fails every request it holds or has queued, refuses new ones with
the reason, stops being ready and tells its owner once (`serve` then exits so the group is rebuilt)."""

import threading

import pytest

from engine.core.admission import EngineError
from engine.core.llm_engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.core.sampling_params import SamplingParams
from engine.model.tokenizer import Tokenizer


def test_a_failing_engine_thread_fails_its_requests_and_refuses_new_ones(tiny_model_dir):
    engine = LLMEngine(load_model(tiny_model_dir), Tokenizer(tiny_model_dir),
                       EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=4, max_wait_ms=0))
    told: list[str] = []
    engine.on_failure = told.append

    def broken_observe(plan):  # outside the model step, where a failed step is already handled per batch
        raise RuntimeError("bookkeeping bug")

    engine._observe = broken_observe
    engine.ready = True
    engine.start()
    results: list = []
    caller = threading.Thread(target=lambda: results.extend(
        engine.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))))
    caller.start()
    caller.join(timeout=60)
    try:
        assert not caller.is_alive(), "generate() must not wait on a dead engine thread"
        assert [r.finish_reason for r in results] == ["error", "error"]
        assert len(told) == 1 and "RuntimeError: bookkeeping bug" in told[0]
        assert engine.ready is False
        with pytest.raises(EngineError, match="bookkeeping bug"):
            engine.submit([3, 4], SamplingParams(max_tokens=2), lambda out: None)
    finally:
        engine.stop()
