"""The OpenAI-compatible HTTP front of one engine: app, protocol, auth, errors, metrics."""
