"""The HTTP toolkit shared by the worker (`server`) and the router: OpenAI-shaped errors, bounded
and strictly checked JSON bodies, OpenAI request validation, request ids, SSE responses and the
uvicorn start-up. Nothing here imports torch, the engine or the router."""
