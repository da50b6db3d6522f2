"""The fit planner, one job per module; ``localspec.plan`` re-exports its public names.

Imports point one way: types ← memory ← speed ← layout ← capacity ← search, with inputs,
facts (← gguf_header), candidates, result and render (← result) beside them; the module map
is in docs/planning.md. Nothing here imports the engine, the server or the settings model.
"""
