"""The fit planner, one job per module; ``localspec.plan`` is its public face.

Imports point one way: types ← settings, gguf_header ← facts ← candidates; types ← memory ←
speed ← layout ← capacity ← search; render ← result ← search.
"""
