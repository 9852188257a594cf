"""`tideflow serve` as a real subprocess: flags, env API keys, the openai client, clean shutdown."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine.serve_cli import add_commands, engine_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cli_server(tiny_model_dir, tmp_path):
    port = _free_port()
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\nfile-key\n")
    env = os.environ | {"TIDEFLOW_API_KEYS": "env-key-1,env-key-2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.serve_cli", "serve", "--model", str(tiny_model_dir), "--port", str(port),
         "--api-key-file", str(key_file), "--kv-cache-bytes", str(8 << 20), "--max-wait-ms", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited {proc.returncode}: {proc.stdout.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/ready", headers={"Authorization": "Bearer env-key-2"}).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("serve did not become ready in 90 s")
            time.sleep(0.1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


def test_serve_subprocess_answers_the_openai_client(cli_server, tiny_model_dir):
    url, proc = cli_server
    for key in ("env-key-1", "file-key"):
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        assert model == tiny_model_dir.name
        out = c.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0)
        assert out.usage.completion_tokens >= 1
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 0
    assert b"env-key" not in proc.stdout.read()


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
