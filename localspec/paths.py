"""Where localspec keeps its files, per user, per OS (platformdirs)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "localspec"


def user_config_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_CONFIG_DIR") or platformdirs.user_config_dir(APP))


def system_config_dir() -> Path:
    """IT-managed profiles: /etc/xdg/localspec on Linux, /Library/Application Support on macOS."""
    return Path(os.environ.get("LOCALSPEC_SYSTEM_CONFIG_DIR") or platformdirs.site_config_dir(APP))


def user_data_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_DATA_DIR") or platformdirs.user_data_dir(APP))


def models_dir() -> Path:
    return Path(os.environ.get("LOCALSPEC_MODELS_DIR") or user_data_dir() / "models")


def state_dir() -> Path:
    """Runtime state: the daemon's pid file and logs."""
    return Path(os.environ.get("LOCALSPEC_STATE_DIR") or platformdirs.user_state_dir(APP))


def cache_dir() -> Path:
    """What can be rebuilt: the slots' contexts kept across restarts, the wheel cache."""
    return Path(os.environ.get("LOCALSPEC_CACHE_DIR") or platformdirs.user_cache_dir(APP))
