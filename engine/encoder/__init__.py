"""The encoder role: images in OpenAI content parts -> vision embeddings spliced into the prompt."""
