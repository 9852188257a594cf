"""A real uvicorn server on 127.0.0.1 (in a background thread) over an engine on the tiny model."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from engine.core.llm_engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.server.app import create_app
from engine.api.inproc import serve_in_thread
from engine.model.tokenizer import Tokenizer

API_KEY = "test-key-123"
MODEL = "tiny"


class Served:
    def __init__(self, engine: LLMEngine, url: str) -> None:
        self.engine, self.url = engine, url

    def client(self, key: str | None = API_KEY, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)

    def counter(self, name: str, **labels) -> float:
        """Current value of a tideflow_* sample read from the engine's registry."""
        return self.engine.metrics.value(name, **labels)


@contextlib.contextmanager
def serve(model_dir, config: EngineConfig, keys=(API_KEY,), warm_up: bool = True):
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    engine = LLMEngine(model, tokenizer, config)
    with serve_in_thread(create_app(engine, MODEL, list(keys), warm_up=warm_up), "engine") as url:
        served = Served(engine, url)
        if warm_up:
            wait_ready(served)
        yield served


def wait_ready(served: Served, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with served.client() as c:
        while c.get("/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready")
            time.sleep(0.05)


def wait_until(predicate, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve(tiny_model_dir, EngineConfig(kv_cache_bytes=64 << 20, max_wait_ms=2, max_batch_tokens=512)) as s:
        yield s
