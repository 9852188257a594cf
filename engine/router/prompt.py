"""Turns an OpenAI request into prompt token ids, as the engine would (PD groups need them here)."""

from __future__ import annotations

from pathlib import Path

from engine.server.requests import parse_body, prompt_ids
from engine.tokenizer import Tokenizer


class PromptPreparer:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer(model_dir)

    def prepare(self, api: str, body: dict) -> list[int]:
        return prompt_ids(self.tokenizer, parse_body(api, body))
