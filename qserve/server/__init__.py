"""`qserve serve`: an OpenAI-compatible HTTP server over one engine.

    async_engine.py   the engine thread, and per-request output queues
    protocol.py       OpenAI request validation and response shapes
    api.py            the ASGI app (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
                      /health, /metrics; and `serve()`, which runs it under uvicorn
    metrics.py        Prometheus metrics
"""
