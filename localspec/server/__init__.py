"""The llama-server compatible HTTP daemon (llama-vscode and llama.vim use it unchanged)."""

from localspec.server.app import create_app
from localspec.server.run import serve
from localspec.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]
