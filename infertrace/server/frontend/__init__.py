"""The HTTP front end: the OpenAI-compatible app, request parsing, streaming, tokenizing, state and metrics."""
