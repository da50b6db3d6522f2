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
# Once the process holds more OpenMP threads than the machine has CPUs (a chat model's worker
# keeps its team beside the completion engine's), libgomp cuts every barrier's spin to its
# "throttled" count: 100 iterations, or 1 000 under ACTIVE (never more than GOMP_SPINCOUNT);
# at 100 ggml's threads sleep and wake at nearly every graph node, and completions decoded at
# half speed after one chat request on 2 cores. With GOMP_SPINCOUNT set above, ACTIVE changes
# nothing else (docs/engine.md, "One process, several thread teams").
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

try:
    __version__ = version("localspec")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
