"""The engine core: what one serving engine does between a request's token ids and its sampled tokens.

One concept per module: `sequence` (a request's life), `kv_cache` (the block allocator and KV bytes),
`shuttle` and `scheduler` (who runs each step), `model_runner` (one model step over the paged cache),
`sampling` (the batch's next tokens, on its device), `stop` and `output_text` (when a request ends, and its
text), `pd` (prefill -> decode handoff), `resume` (a request continued on another worker), `outputs` (what a
request's stream carries), `engine_config` (the knobs) and `llm_engine` (the loop that ties them together).
Nothing here speaks HTTP: engine/server/ does.
"""
