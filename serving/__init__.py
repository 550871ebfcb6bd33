"""OpenAI-compatible HTTP server (`python -m serving.launch`) over the dspark-jax engine.

    launch.py        CLI: flags, engine construction with compile progress, uvicorn with SIGTERM draining
    app.py           the FastAPI app: error handlers, routers, /health, /metrics, /server_info
    openai_api.py    /v1/completions, /v1/chat/completions, /v1/models
    generate_api.py  /generate (SGLang's native endpoint)
    dispatch.py      one HTTP request -> its engine requests (n choices, batches) and back; SSE
    protocol.py      request models (pydantic) and the one list of refused parameters
    params.py        validated requests -> prompts, SamplingParams, choices
    responses.py     response bodies, stream chunks, usage, stop-safe text deltas
    errors.py        ApiError and what validation / engine errors mean over HTTP
    jsonbody.py      reading and parsing request bodies within fixed bounds
    state.py         ServerConfig and the state the endpoints share
    engine_loop.py   the single thread that owns the Engine; queues to and from the HTTP loop
    chat.py          chat messages -> prompt (model chat template, or the plain template)
    metrics.py       Prometheus metrics
"""
