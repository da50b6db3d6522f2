"""The llama-server compatible HTTP daemon (llama-vscode and llama.vim use it unchanged)."""

from localspec.server.app import create_app
from localspec.server.options import ServerSettings
from localspec.server.run import serve
from localspec.server.upstream.config import UpstreamSettings

__all__ = ["ServerSettings", "UpstreamSettings", "create_app", "serve"]
