"""localspec: fast local code completion with speculative decoding and KV cache reuse."""

import os
from importlib.metadata import PackageNotFoundError, version

# llama.cpp's OpenMP threads wait at ggml's barriers (one after every graph node) by spinning
# this many iterations before they sleep; libgomp reads it once, when llama.cpp's library
# loads. Its default (300 000) lets a thread whose partner was descheduled by another
# process burn a whole scheduler slice at nearly every barrier; 10 000 costs nothing on an
# idle machine and halves that stall in the moments before the thread count follows the load
# (engine/threads.py, docs/engine.md "Threads follow the load"). A user's own setting stays.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

try:
    __version__ = version("localspec")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
