"""Turns an OpenAI request into prompt token ids, as the engine would (PD groups need them here), and refuses
what cannot fit the model before spending time on it.

The cost is bounded before the work starts: a token stands for no more characters than (twice) the
vocabulary's longest entry, so a longer prompt than context x that cannot fit and is refused without being
tokenized (a 7 MB prompt used to be tokenized and expanded into a body the members then refused with 413).
"""

from __future__ import annotations

from pathlib import Path

from engine.model.config import read_config
from engine.api.errors import APIError
from engine.api.protocol import ChatCompletionRequest
from engine.api.requests import check_prompt_chars, check_token_ids, parse_body, prompt_ids
from engine.model.tokenizer import Tokenizer


class PromptPreparer:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer(model_dir)
        config = read_config(model_dir)
        self.context_length, self.vocab_size = config.context_length, config.vocab_size

    def prepare(self, api: str, body: dict) -> list[int]:
        """The prompt's token ids; APIError 400 naming the limit when it cannot fit the model's context."""
        parsed = parse_body(api, body)
        check_prompt_chars(parsed, self.tokenizer, self.context_length)
        ids = prompt_ids(self.tokenizer, parsed)
        check_token_ids(ids, self.vocab_size)
        wanted = (parsed.max_completion_tokens or parsed.max_tokens or 1) if isinstance(parsed, ChatCompletionRequest) \
            else (parsed.max_tokens or 1)
        if len(ids) + wanted > self.context_length:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({wanted}) exceeds the model's context of "
                                f"{self.context_length} tokens; shorten the prompt or lower max_tokens",
                           param="max_tokens" if len(ids) < self.context_length else "prompt",
                           code="context_length_exceeded")
        return ids

