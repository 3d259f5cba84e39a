"""The OpenAI-compatible HTTP worker: request parsing, the FastAPI app, metrics and `serve`."""
