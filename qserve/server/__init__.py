"""`qserve serve`: an OpenAI- and Ollama-compatible HTTP server over one engine.

    async_engine.py   the engine thread, and per-request output queues
    protocol.py       OpenAI request validation and response shapes
    ollama.py         Ollama's /api routes: its requests as OpenAI's, its response shapes
    http.py           what both APIs' handlers share: JSON bodies, tokenizing, waiting, streams
    api.py            the ASGI app (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
                      /v1/embeddings, Ollama's /api/..., /tokenize, /detokenize, /health,
                      /metrics; and `serve()`, which runs it under uvicorn
    metrics.py        Prometheus metrics
"""
