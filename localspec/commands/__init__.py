"""One module per command group; each declares its commands' texts (``common.Command``) at the
top and has ``register(subparsers)``, which adds each with its handler, a callable
``(args) -> exit code``. Heavy imports (the server, llama.cpp, the hub client) happen inside
those handlers so ``localspec --help`` stays instant."""
