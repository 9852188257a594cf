"""The engine thread alone runs parallel ops in a serving process (engine/runtime/intraop.py). The rule is
process-wide, so it is checked in a fresh interpreter, as `serve` starts one."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

PROBE = textwrap.dedent("""
    import json, sys, threading
    import torch
    from engine.runtime import intraop
    from engine.core.llm_engine import EngineConfig, LLMEngine
    from engine.core.sampling_params import SamplingParams

    given = intraop.serial_process()
    seen = {"given": given, "main": torch.get_num_threads()}
    engine = LLMEngine.from_dir(sys.argv[1], EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=2))
    runner_allocate = engine.runner.allocate

    def allocate(num_blocks):
        seen["allocated_on"] = threading.current_thread().name
        seen["engine_threads"] = torch.get_num_threads()
        runner_allocate(num_blocks)

    engine.runner.allocate = allocate
    engine.start()
    try:
        engine.release_kv()
        threading.Thread(target=engine.allocate_kv, args=(8,), name="caller").start()
        import time
        deadline = time.monotonic() + 30
        while "allocated_on" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        out = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
        seen["tokens"] = len(out[0].token_ids)
        seen["main_after"] = torch.get_num_threads()
        seen["blocks"] = engine.allocator.num_blocks
    finally:
        engine.stop()
    print(json.dumps(seen))
""")


def probe(model_dir, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", PROBE, str(model_dir)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_thread_takes_the_process_threads_and_the_kv_cache_is_made_there(tiny_model_dir):
    seen = probe(tiny_model_dir, threads=2)
    assert seen["given"] == 2, "the count the process was started with is what the engine gets"
    assert seen["main"] == 1 and seen["main_after"] == 1, "the main thread stays serial while the engine runs"
    assert seen["engine_threads"] == 2
    assert seen["allocated_on"] == "tideflow-engine", "a KV allocation asked from another thread runs on the engine's"
    assert seen["blocks"] == 8 and seen["tokens"] == 4
