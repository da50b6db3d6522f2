"""One module per command group; each has ``register(subparsers)`` and sets ``func`` on its
parser, a callable ``(args) -> exit code``. Heavy imports (the server, llama.cpp, the hub
client) happen inside those functions so ``localspec --help`` stays instant."""
