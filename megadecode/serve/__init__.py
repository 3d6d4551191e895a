"""`megadecode serve`: an OpenAI-compatible HTTP server with continuous batching over the engine.

    protocol.py  the request fields, checked (400 with an OpenAI-style error body)
    chat.py      chat messages to prompt tokens (the checkpoint's template, or a documented fallback)
    text.py      tokens to text: incremental detokenization, stop strings
    loop.py      the engine loop thread: scheduler + model runner, one step after another
    server.py    the loop, the queues to the handlers, startup (captures, cold start)
    metrics.py   Prometheus metrics
    api.py       the FastAPI app (uvicorn)
    main.py      the command: build, warm up, serve

Needs the `serve` extra (fastapi, uvicorn, prometheus-client): `pip install -e ".[serve]"`.
"""
