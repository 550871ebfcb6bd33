"""OpenAI-compatible HTTP server (`python -m serving.launch`) over the dspark-jax engine.

The server lands with the serving issue; this package reserves its place in the layout.
"""
