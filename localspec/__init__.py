"""localspec: fast local code completion with speculative decoding and KV cache reuse."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("localspec")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
