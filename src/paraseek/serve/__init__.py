"""The OpenAI-compatible server over the inference engine: routes and errors (api.py), request schemas (protocol.py), the engine loop (loop.py), Prometheus metrics (metrics.py)."""
