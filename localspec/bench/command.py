"""What the benchmark commands share: their argument parser's shape, and running with SIGTERM,
SIGHUP (the terminal closed) or SIGINT (also in a background job) turned into
KeyboardInterrupt, so the servers they started are stopped, then the process's own handlers
put back."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path


def bench_parser(prog: str, doc: str | None, epilog: str) -> argparse.ArgumentParser:
    """A parser whose description is the module docstring's second paragraph."""
    return argparse.ArgumentParser(
        prog=prog,
        description=doc.split("\n\n")[1] if doc else None,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # `--api-key KEY` is refused, not read as --api-key-file
    )


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def interruptible(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``run(args)`` with SIGTERM, SIGHUP and SIGINT raising KeyboardInterrupt (main thread only);
    an interrupted run (its servers stopped by its own ``finally``) exits 130."""
    if threading.current_thread() is not threading.main_thread():
        return _until_interrupted(run, args)
    signals = [
        signal.SIGTERM,
        signal.SIGINT,
        *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []),
    ]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    for sig in saved:
        signal.signal(sig, _interrupt)
    try:
        return _until_interrupted(run, args)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _until_interrupted(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def key_from_file(path: Path | None) -> str | None:
    """A benchmark's key for a running daemon, read under the secret files' rule (mode 600)."""
    from localspec.settings import read_secret_file

    return read_secret_file(path.expanduser(), "--api-key-file") if path is not None else None
