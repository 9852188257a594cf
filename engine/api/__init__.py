"""The HTTP kit every tideflow server shares (members, the router, the encoder, the controller): bearer keys, error
objects, body and connection limits, the OpenAI protocol models and request parsing, heartbeats, the CPU pool
for request work, and serving an app on a thread."""
