"""Who a router request is from: its API key, the tenant that key names, and the cache salt
of that tenant.

Keys come from ``router.api_keys_file`` and the environment variable ``KVSTORE_ROUTER_API_KEYS``
(both may be used; a key in both must name one tenant). The file is, by its suffix:

- ``.toml``: ``"sk-…" = "team-a"``, one key a line;
- ``.json``: ``{"sk-…": "team-a", …}``;
- anything else: lines ``sk-… team-a`` (key, whitespace, tenant), ``#`` comments.

The variable holds ``tenant:key`` entries separated by commas or whitespace. A key has at
least 16 characters and no whitespace; a tenant name is 1 to 64 of ``A-Z a-z 0-9 . _ -``
(it becomes a metric label and the input of its salt).

The router keeps only each key's SHA-256 digest, so neither a log line nor a repr can show a
key, and compares a presented key's digest with every known one in constant time
(`hmac.compare_digest`). A tenant's salt is an HMAC of its name under the router's secret
(``KVSTORE_ROUTER_SALT_SECRET`` or ``router.salt_secret_file``): router replicas that share
the secret give a tenant the same salt, so its blocks are shared among its own requests and
never with another tenant's, and no client can compute another tenant's salt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import ConfigError, read_toml

__all__ = ["KEYS_ENV", "SALT_SECRET_ENV", "ApiKeys", "load_api_keys", "load_salt_secret", "presented_key", "tenant_salt"]

KEYS_ENV = "KVSTORE_ROUTER_API_KEYS"
SALT_SECRET_ENV = "KVSTORE_ROUTER_SALT_SECRET"
MIN_KEY_CHARS = 16
MIN_SECRET_BYTES = 16
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SALT_CONTEXT = b"kvstore router cache_salt\x00"  # a digest of this secret means nothing elsewhere


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """Known keys, as (SHA-256 of the key, its tenant). Empty: the router takes anyone."""

    digests: tuple[tuple[bytes, str], ...] = ()

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.digests)} keys)"

    def __bool__(self) -> bool:
        return bool(self.digests)

    def tenant_of(self, key: str) -> str | None:
        """The tenant ``key`` names, or None. Every known digest is compared, whichever
        matches, so the time taken says nothing about how near a guess came."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found = None
        for known, tenant in self.digests:
            if hmac.compare_digest(known, digest) and found is None:
                found = tenant
        return found


def presented_key(headers: Mapping[str, str]) -> str:
    """The key a request presents: ``Authorization: Bearer KEY``, else ``x-api-key: KEY``
    ('' when neither)."""
    scheme, _, credential = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and credential.strip():
        return credential.strip()
    return headers.get("x-api-key", "").strip()


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The ``cache_salt`` of ``tenant``'s requests: 128 bits of HMAC-SHA256, in hex."""
    return hmac.new(secret, _SALT_CONTEXT + tenant.encode(), hashlib.sha256).hexdigest()[:32]


def load_api_keys(path: str, environ: Mapping[str, str]) -> ApiKeys:
    """The keys of the file at ``path`` ('' for none) and of ``KVSTORE_ROUTER_API_KEYS``."""
    entries: list[tuple[str, str, str]] = []  # (key, tenant, where: for a sentence that never shows the key)
    if path:
        entries += _file_entries(Path(path))
    for number, entry in enumerate(environ.get(KEYS_ENV, "").replace(",", " ").split(), start=1):
        tenant, sep, key = entry.partition(":")
        if not sep:
            raise ConfigError(f"{KEYS_ENV}: entry {number} must be tenant:key (entries separated by commas or spaces).")
        entries.append((key, tenant, f"{KEYS_ENV} entry {number}"))
    tenant_by_digest: dict[bytes, str] = {}
    for key, tenant, where in entries:
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise ConfigError(f"{where}: an API key must have at least {MIN_KEY_CHARS} characters and no whitespace.")
        if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
            raise ConfigError(f"{where}: the tenant name must be 1 to 64 of A-Z, a-z, 0-9, '.', '_' and '-'.")
        digest = hashlib.sha256(key.encode()).digest()
        if tenant_by_digest.setdefault(digest, tenant) != tenant:
            raise ConfigError(f"{where}: this API key already names the tenant {tenant_by_digest[digest]!r}; a key names one tenant.")
    return ApiKeys(tuple(tenant_by_digest.items()))


def _file_entries(path: Path) -> list[tuple[str, str, str]]:
    if path.suffix == ".toml":
        return _mapping_entries(read_toml(path), path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the API key file {path} (router.api_keys_file): {exc.strerror}.") from exc
    if path.suffix == ".json":
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{path} is not valid JSON (line {getattr(exc, 'lineno', '?')}): write an object of key: tenant.") from None
        if not isinstance(document, dict):
            raise ConfigError(f"{path} must hold one JSON object of key: tenant.")
        return _mapping_entries(document, path)
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ConfigError(f"{path} line {number}: write the key, then whitespace, then its tenant.")
        entries.append((fields[0], fields[1], f"{path} line {number}"))
    return entries


def _mapping_entries(document: Mapping[str, object], path: Path) -> list[tuple[str, str, str]]:
    entries: list[tuple[str, str, str]] = []
    for number, (key, tenant) in enumerate(document.items(), start=1):
        where = f"{path} entry {number}"
        if not isinstance(tenant, str):
            raise ConfigError(f"{where}: a key's tenant must be a string.")
        entries.append((key, tenant, where))
    return entries


def load_salt_secret(path: str, environ: Mapping[str, str]) -> bytes:
    """The router's secret for tenant salts: the file at ``path`` (stripped), else
    ``KVSTORE_ROUTER_SALT_SECRET``; b'' when neither is given."""
    if path:
        try:
            return Path(path).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the salt secret file {path} (router.salt_secret_file): {exc.strerror}.") from exc
    return environ.get(SALT_SECRET_ENV, "").encode()
