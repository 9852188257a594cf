"""The gateway in front of a group set: OpenAI API, stage load balancers, health, weights."""
