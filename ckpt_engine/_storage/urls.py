"""Telling URLs from local paths, and the fsspec options of the protocols the engine configures.

Nothing here touches a filesystem: the configuration imports it to validate paths without
importing the stores themselves.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL for a non-local filesystem (``file://`` counts as local)."""
    s = os.fspath(path)
    return "://" in s and not s.startswith("file://")


def local_path(path: str) -> str:
    """``path`` with a ``file://`` prefix removed (``file:///a/b`` -> ``/a/b``); others unchanged."""
    return path[len("file://") :] if path.startswith("file://") else path


def s3_options(
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    session_token: str | None = None,
    profile: str | None = None,
    anon: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """s3fs constructor options from the engine's ``storage`` fields; unset fields fall back to
    boto's standard sources (``AWS_*`` environment variables, ``~/.aws``, instance roles)."""
    opts: dict[str, Any] = {}
    if endpoint_url:
        opts["endpoint_url"] = endpoint_url
    if access_key_id:
        opts["key"] = access_key_id
    if secret_access_key:
        opts["secret"] = secret_access_key
    if session_token:
        opts["token"] = session_token
    if profile:
        opts["profile"] = profile
    if anon:
        opts["anon"] = True
    client_kwargs: dict[str, Any] = {}
    if region:
        client_kwargs["region_name"] = region
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    # botocore's own retries would multiply ours; transient errors are retried by FsspecStore.call.
    opts["config_kwargs"] = {"retries": {"max_attempts": 1, "mode": "standard"}}
    opts.update(extra or {})
    return opts
