"""Model files: verified, resumable, offline-first downloads through huggingface_hub.

- ``files``: where files live on disk, their verification records, finding a good copy;
- ``hub``: downloading what is missing (``pull``);
- ``plan_files``: what ``localspec up`` needs (a plan's files, the network settings);
- ``status``: what is on disk, for ``localspec models``.
"""

from localspec.catalog_refresh import Change, refresh_catalog
from localspec.fetch.errors import FetchError, OfflineError, VerifyError
from localspec.fetch.files import FileSpec, find_local, resolve_local, specs_for
from localspec.fetch.hub import pull
from localspec.fetch.plan_files import apply_network_settings, hub_options, pull_plan
from localspec.fetch.status import QuantStatus, model_status

__all__ = [
    "Change",
    "FetchError",
    "FileSpec",
    "OfflineError",
    "QuantStatus",
    "VerifyError",
    "apply_network_settings",
    "find_local",
    "hub_options",
    "model_status",
    "pull",
    "pull_plan",
    "refresh_catalog",  # lives in catalog_refresh; re-exported for the CLI
    "resolve_local",
    "specs_for",
]
