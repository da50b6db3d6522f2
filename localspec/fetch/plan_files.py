"""What ``localspec up`` needs of the downloads: the plan's files, and the network settings
(proxy, CA bundle) huggingface_hub picks up from the environment."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypedDict

from localspec.catalog import Catalog
from localspec.fetch.hub import pull
from localspec.planning.result import Plan
from localspec.settings import Settings, read_secret_file

DEFAULT_HUB = "https://huggingface.co"  # hub.endpoint unset (and HF_ENDPOINT not set)


def apply_network_settings(*, proxy: str | None = None, ca_bundle: Path | None = None) -> None:
    """Route huggingface_hub through a proxy / trust a CA bundle (profile keys).

    Its HTTP client reads HTTPS_PROXY and SSL_CERT_FILE when created, so set them and drop
    the client it may already hold.
    """
    if proxy:
        os.environ["HTTPS_PROXY"] = os.environ["HTTP_PROXY"] = proxy
    if ca_bundle:
        os.environ["SSL_CERT_FILE"] = str(Path(ca_bundle).expanduser())
    if proxy or ca_bundle:
        from huggingface_hub import close_session

        close_session()


class HubOptions(TypedDict):
    """``pull``'s keyword arguments that the settings decide."""

    endpoint: str | None
    offline: bool
    token: str | None
    readonly_dirs: list[Path]


def hub_options(settings: Settings) -> HubOptions:
    """The hub settings as ``pull``'s keyword arguments (the token file read under the secret
    files' rule); proxy and CA bundle go through the environment, which huggingface_hub's
    HTTP client reads."""
    hub = settings.hub
    apply_network_settings(proxy=hub.proxy, ca_bundle=hub.ca_bundle)
    token = None
    if hub.token_file is not None:
        token = read_secret_file(hub.token_file.expanduser(), "hub.token_file")
    return HubOptions(
        # never None: huggingface_hub would read HF_ENDPOINT itself, which a lock on
        # hub.endpoint (HF_ENDPOINT's setting) has refused
        endpoint=hub.endpoint or DEFAULT_HUB,
        offline=hub.offline,
        token=token,
        readonly_dirs=[Path(d).expanduser() for d in settings.models.dirs],
    )


def pull_plan(
    plan: Plan,
    *,
    settings: Settings,
    catalog: Catalog | None = None,
    progress: bool = True,
) -> tuple[Path, Path | None]:
    """The plan's target and draft files, present and verified (downloading what is missing).

    ``plan.target``/``plan.draft`` are (model id, quant); the hub settings and models.dirs
    come from ``settings``.
    """
    from localspec.catalog import load_catalog

    catalog = catalog if catalog is not None else load_catalog()
    quants = [catalog.model(plan.target[0]).quants[plan.target[1]]]
    if plan.draft is not None:
        quants.append(catalog.model(plan.draft[0]).quants[plan.draft[1]])
    paths = pull(quants, progress=progress, **hub_options(settings))
    # pull returns every shard; llama.cpp is given the first file of each quant
    target = paths[0]
    draft = paths[len(quants[0].files)] if plan.draft is not None else None
    return target, draft
