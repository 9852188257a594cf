"""The log-probabilities a request asked for, in OpenAI's two shapes: the chat API's entry per token (text, bytes,
log-probability, alternatives) and the completions API's parallel lists (with each token's offset in the text).

The engine reports ids and numbers (engine.core.sampling_params.Logprob); the text of each id is made here, where the
tokenizer is, by the process that answers the client.
"""

from __future__ import annotations

from engine.core.sampling_params import Logprob
from engine.api.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from engine.model.tokenizer import Tokenizer


class LogprobText:
    """Turns token ids and their Logprobs into the response shapes; one per app (the tokenizer caches token bytes)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        """A token's text; bytes that are part of a character show as U+FFFD (the `bytes` field has them whole)."""
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def chat(self, token_ids: list[int], logprobs: list[Logprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            TokenLogprob(**self._entry(token, lp.logprob), top_logprobs=[TopLogprob(**self._entry(t, v)) for t, v in lp.top])
            for token, lp in zip(token_ids, logprobs)
        ])

    def chars(self, token_ids: list[int]) -> int:
        """Characters begun by these tokens' bytes (UTF-8 lead bytes): a stream sums them, chunk after chunk and
        across a handover, and over a whole answer they are the length of its text."""
        return sum(_leads(self.tokenizer.token_bytes(token)) for token in token_ids)

    def completion(self, token_ids: list[int], logprobs: list[Logprob], offset: int) -> CompletionLogprobs:
        """`offset`: chars() of the generated tokens before these (a stream's earlier chunks, and what a resumed
        request's client received from the worker before). A token's offset is the index in the answer's text of
        the character its first byte belongs to: a token that finishes a character another began starts in it."""
        texts = [self.text(token) for token in token_ids]
        offsets = []
        for token in token_ids:
            raw = self.tokenizer.token_bytes(token)
            offsets.append(max(offset - (1 if raw and not _leads(raw[:1]) else 0), 0))
            offset += _leads(raw)
        return CompletionLogprobs(tokens=texts, token_logprobs=[lp.logprob for lp in logprobs], text_offset=offsets,
                                  top_logprobs=[self._alternatives(lp) for lp in logprobs])

    def _alternatives(self, logprob: Logprob) -> dict[str, float]:
        """Text -> log-probability, most likely first; two ids with one text keep the likelier."""
        alternatives: dict[str, float] = {}
        for token, value in logprob.top:
            alternatives.setdefault(self.text(token), value)
        return alternatives

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def _leads(raw: bytes) -> int:
    """UTF-8 bytes that begin a character (every byte but the 10xxxxxx continuations)."""
    return sum(1 for b in raw if b & 0xC0 != 0x80)
