"""What can go wrong getting a model file; each message says what to do next."""

from __future__ import annotations


class FetchError(RuntimeError):
    """A model file could not be obtained; the message says what to do next."""


class OfflineError(FetchError):
    """The network is off and a needed file is not on disk."""


class VerifyError(FetchError):
    """A file's size or sha256 is not what the catalog or the hub says it must be."""
