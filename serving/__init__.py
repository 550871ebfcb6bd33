"""OpenAI-compatible HTTP server (`python -m serving.launch`) over the dspark-jax engine.

    launch.py       CLI: flags, engine construction, uvicorn with SIGTERM draining
    app.py          FastAPI endpoints (/v1/completions, /v1/chat/completions, /v1/models,
                    /generate, /health, /metrics, /server_info) and error bodies
    engine_loop.py  the single thread that owns the Engine; queues to and from the HTTP loop
    protocol.py     request parsing/validation and response shapes
    chat.py         chat messages -> prompt (model chat template, or the plain template)
    metrics.py      Prometheus metrics
"""
