"""Tokens each client has open in one engine, capped: one API key's flood is refused at the door (429) once it
holds its cap, instead of filling the engine's queue and memory for everyone."""

from __future__ import annotations

import threading

CLIENT_CONTEXTS = 16  # the default cap, in whole contexts (EngineConfig.max_client_tokens)


def client_cap(configured: int | None, max_model_len: int) -> int | None:
    """Tokens one client may hold open in an engine: the configured cap, by default room for CLIENT_CONTEXTS
    requests of the whole context (a chat request without max_tokens asks for the rest of it); None: no cap."""
    return CLIENT_CONTEXTS * max_model_len if configured is None else (configured or None)


class ClientTokens:
    """Open tokens (prompt + max_tokens of every request not yet finished) per client. Thread-safe: requests are
    taken on the submitting threads and given back on the engine thread. `cap` None: counted, never refused."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, client: str, tokens: int) -> int | None:
        """Count `tokens` against `client`: None when taken, else what the client holds already (refused)."""
        with self._lock:
            held = self._held.get(client, 0)
            # a client holding nothing is never refused (one request fits the context), nor an unnamed one: ""
            # is every caller a server cannot tell apart (no keys, or a router that has none for its clients)
            if self.cap is not None and client and held and held + tokens > self.cap:
                return held
            self._held[client] = held + tokens
            return None

    def give(self, client: str, tokens: int) -> None:
        with self._lock:
            held = self._held.get(client, 0) - tokens
            if held > 0:
                self._held[client] = held
            else:
                self._held.pop(client, None)

    def held(self, client: str) -> int:
        with self._lock:
            return self._held.get(client, 0)
