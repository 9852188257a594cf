"""A request's text as its tokens arrive: incremental detokenization, stop strings, and the tail held back
because it may still become a stop string.

It needs only the tokenizer and the request's stop strings, never the engine's state: text is made apart
from the model step (on the engine thread while the engine serves in the API server's process, in the API
process once the engine core runs in a process of its own).
"""

from __future__ import annotations

from engine.core.stop import find_stop
from engine.model.tokenizer import IncrementalDecoder, Tokenizer


class RequestText:
    """The text of one request's generated tokens, and how much of it the client was sent."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], streamed: list[int] | None = None,
                 sent_chars: int = 0) -> None:
        """`streamed`/`sent_chars`: a resumed request's tokens and the characters its client already has."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1  # a stop string may begin in the unsent tail
        self.decoder = IncrementalDecoder(tokenizer)
        self.sent_chars = 0
        if streamed:
            self.decoder.prime(streamed)
            self.sent_chars = min(sent_chars, len(self.decoder.text))

    def push(self, token: int) -> bool:
        """Add a generated token; True when the text now holds a stop string (the request ends)."""
        self.decoder.push(token)
        return bool(self.stop) and find_stop(self.decoder.text, self.stop) is not None

    def delta(self) -> str:
        """The text not sent yet, minus the tail that may still turn into a stop string; marked as sent."""
        visible = len(self.decoder.text) - self.holdback
        if visible <= self.sent_chars:
            return ""
        text = self.decoder.text[self.sent_chars : visible]
        self.sent_chars = visible
        return text

    def rest(self, tokens: list[int]) -> str:
        """The last delta of a finished request whose output is `tokens`: everything unsent, cut where the
        first stop string begins (the stop string is not part of the answer)."""
        final = self.tokenizer.decode(tokens)
        cut = find_stop(final, self.stop) if self.stop else None
        return (final if cut is None else final[:cut])[self.sent_chars :]
