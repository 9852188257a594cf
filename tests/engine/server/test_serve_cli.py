"""`tideflow serve` as a real subprocess: flags, env API keys, the openai client, clean shutdown, and the exit
of a member whose engine thread died."""

from __future__ import annotations

import argparse
import signal
import sys

import httpx
import openai
import pytest

from engine.runtime.errors import EXIT_ENGINE_FAILED
from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok
from engine.server.cli import add_commands, engine_config

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


@pytest.fixture
def cli_server(tiny_model_dir, tmp_path):
    port = free_port()
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\nfile-key\n")
    argv = tideflow_argv("serve", "--model", str(tiny_model_dir), "--port", str(port), "--api-key-file", str(key_file),
                         "--kv-cache-bytes", str(8 << 20), "--max-wait-ms", "1")
    child = Child("serve-cli", argv, tmp_path / "serve.log", {"TIDEFLOW_API_KEYS": "env-key-1,env-key-2"})
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ok(url + "/ready", 90, child, "env-key-2"):
            raise RuntimeError(f"serve did not become ready: {child.log_tail()}")
        yield url, child
    finally:
        child.stop()


def test_serve_subprocess_answers_the_openai_client(cli_server, tiny_model_dir):
    url, child = cli_server
    for key in ("env-key-1", "file-key"):
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        assert model == tiny_model_dir.name
        out = c.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0)
        assert out.usage.completion_tokens >= 1
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    child.proc.send_signal(signal.SIGINT)
    assert child.proc.wait(timeout=20) == 0
    log = child.log_path.read_text()
    assert "env-key" not in log
    assert f"INFO engine.server.cli: serving {tiny_model_dir.name} on http://127.0.0.1" in log  # its start, for operators


def test_flags_build_the_engine_config():
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "/models/my-moe", "--max-num-seqs", "8", "--kv-cache-fraction", "0.1",
                              "--max-wait-ms", "0", "--dtype", "bfloat16"])
    config = engine_config(args)
    assert (config.model_name, config.max_num_seqs, config.kv_cache_fraction, config.max_wait_ms, config.dtype) == (
        "my-moe", 8, 0.1, 0.0, "bfloat16")
    assert args.host == "127.0.0.1" and args.func.__name__ == "serve"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--kv-cache-bytes", "1", "--kv-cache-fraction", "0.1"])


# `serve` with one bookkeeping step of the engine loop broken once a trigger file exists: how a bug outside
# the model step (where a failure fails only its batch) ends the engine thread of a running member.
BROKEN_AFTER_TRIGGER = """
import os, sys
from engine.core import llm_engine
from engine.main import main
observe = llm_engine.LLMEngine._observe
def observe_until_triggered(self, plan):
    if os.path.exists(os.environ["BREAK_ENGINE_WHEN"]):
        raise RuntimeError("bookkeeping bug")
    return observe(self, plan)
llm_engine.LLMEngine._observe = observe_until_triggered
sys.exit(main(sys.argv[1:]))
"""


def test_a_member_whose_engine_thread_died_fails_the_request_and_exits(tiny_model_dir, tmp_path):
    port, trigger = free_port(), tmp_path / "break-now"
    argv = [sys.executable, "-c", BROKEN_AFTER_TRIGGER, "serve", "--model", str(tiny_model_dir), "--port", str(port),
            "--kv-cache-bytes", str(8 << 20), "--max-wait-ms", "1"]
    child = Child("serve-broken", argv, tmp_path / "serve.log", {"TIDEFLOW_API_KEYS": "k", "BREAK_ENGINE_WHEN": str(trigger)})
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_http_ok(url + "/ready", 90, child, "k"), child.log_tail()
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0).usage.completion_tokens
        trigger.touch()
        with pytest.raises(openai.APIError):  # an error answer, or the connection closed by the exit
            client.completions.create(model=model, prompt="hello again", max_tokens=16, temperature=0)
        assert child.proc.wait(timeout=30) == EXIT_ENGINE_FAILED  # the group manager sees a dead member
        assert "bookkeeping bug" in child.log_path.read_text()
    finally:
        child.stop()
