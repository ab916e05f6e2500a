"""Tenants: who a call is for, what it may call and how much it may hold, from an auth file of token hashes.

An auth file (`serve ... --auth-file PATH`) is TOML with one `[[tenant]]` table per tenant:

    [[tenant]]
    name = "team-a"
    token_sha256 = "<hex sha256 of the bearer token>"   # the file never holds a token
    rpcs = ["score", "generate"]                         # roles (ROLES) or rpc names; default: all
    max_concurrent_calls = 4
    max_requests_per_second = 20
    max_memory_sessions = 2
    max_memory_bytes = "4G"
    max_engine_rows = 8

A shared `--token` is the table of one tenant, DEFAULT_TENANT, with every rpc and no quotas. A call's
tenant is found by comparing the sha256 of its token with every tenant's in constant time, and is set
for the call's task (`current_tenant`) by the admission check (services.common.security), so servicers
and the metrics label read it without plumbing. Unknown keys are refused by name when the file is read.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass, fields
from pathlib import Path

from memlm.v1 import language_model_pb2, retrieval_pb2
from services.common.sizes import parse_bytes

DEFAULT_TENANT = "default"
"""The tenant of a shared `--token` (or of every caller without authentication)."""
NO_TENANT = "-"
"""The `tenant` label of a call refused before its tenant was known (a missing or wrong token)."""

_LM = "/memlm.v1.LanguageModelService/"
_RETRIEVAL = "/memlm.v1.RetrievalService/"
_MEMORY = "/memlm.v1.MemoryService/"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

ROLES: dict[str, frozenset[str]] = {
    "score": frozenset({_LM + "Score", _LM + "Tokenize", _LM + "GetInfo"}),
    "generate": frozenset({_LM + "Generate", _LM + "Tokenize", _LM + "GetInfo"}),
    "search": frozenset({_RETRIEVAL + "Search", _RETRIEVAL + "GetInfo", _RETRIEVAL + "Successors"}),
    "memory": frozenset(_MEMORY + m.name for m in retrieval_pb2.DESCRIPTOR.services_by_name["MemoryService"].methods),
    "admin": frozenset({REFLECTION}),
}
"""What a role in `rpcs` allows: full method names. Info rpcs go with the roles whose clients need them."""

KNOWN_RPCS: frozenset[str] = frozenset(
    f"/{service.full_name}/{m.name}"
    for module in (language_model_pb2, retrieval_pb2) for service in module.DESCRIPTOR.services_by_name.values()
    for m in service.methods) | {REFLECTION}
"""Every rpc a tenant's `rpcs` may name (by its full name or by the method name alone)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


class AuthFileError(ValueError):
    """An auth file that cannot serve: bad TOML, an unknown key, a bad value (the message says which)."""


@dataclass(frozen=True)
class Quotas:
    """What one tenant may hold at once; None = no limit of its own (the server's limits still apply)."""

    max_concurrent_calls: int | None = None
    """Calls in progress at once; RESOURCE_EXHAUSTED past it."""
    max_requests_per_second: float | None = None
    """Calls started per second, averaged over a second (a token bucket holding one second of calls)."""
    max_memory_sessions: int | None = None
    """Memory sessions (MemoryService) open at once."""
    max_memory_bytes: int | None = None
    """Bytes all its memory sessions together reserve (keys and values, as `max_total_bytes` counts them)."""
    max_engine_rows: int | None = None
    """Rows of the LM server's engine (one per Generate call, one per engine Score input) held at once."""


QUOTA_KEYS = tuple(f.name for f in fields(Quotas))


@dataclass(frozen=True)
class Tenant:
    """One tenant of a server: its name, its token's sha256, the rpcs it may call and its quotas."""

    name: str
    """Names the tenant in messages, metrics and logs."""
    token_sha256: bytes
    """sha256 digest (32 bytes) of its bearer token; b"" for the tenant of a server without authentication."""
    rpcs: frozenset[str] | None = None
    """Full method names it may call; None = every rpc."""
    quotas: Quotas = Quotas()

    def allows(self, method: str) -> bool:
        """Whether this tenant may call `method` ("/package.Service/Rpc")."""
        return self.rpcs is None or method in self.rpcs


OPEN_TENANT = Tenant(DEFAULT_TENANT, b"")
"""The tenant of every call on a server without authentication."""


def token_digest(token: str) -> bytes:
    """sha256 of a bearer token, the form an auth file holds (hex) and calls are matched on."""
    return hashlib.sha256(token.encode()).digest()


class TenantTable:
    """The tenants of a server, matched by token (`identify`). Immutable: a reload builds a new table."""

    def __init__(self, tenants: Iterable[Tenant]) -> None:
        self.tenants = tuple(tenants)
        names = [t.name for t in self.tenants]
        for name in names:
            if names.count(name) > 1:
                raise AuthFileError(f"tenant {name!r} is listed twice")
        digests = [t.token_sha256 for t in self.tenants]
        if len(set(digests)) != len(digests):
            raise AuthFileError("two tenants share one token_sha256")
        if not self.tenants:
            raise AuthFileError("no [[tenant]] table: a server with an auth file needs at least one tenant")

    @classmethod
    def single(cls, token: str) -> TenantTable:
        """The table of a shared token: one tenant, DEFAULT_TENANT, every rpc, no quotas."""
        return cls([Tenant(DEFAULT_TENANT, token_digest(token))])

    @classmethod
    def read(cls, path: Path | str) -> TenantTable:
        """The table of an auth file; AuthFileError naming the file and what is wrong in it."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise AuthFileError(f"auth file {path}: {e}") from None
        try:
            return cls.parse(data)
        except AuthFileError as e:
            raise AuthFileError(f"auth file {path}: {e}") from None

    @classmethod
    def parse(cls, data: dict) -> TenantTable:
        """The table of a parsed auth file (a dict with one key, "tenant": a list of tables)."""
        unknown = sorted(set(data) - {"tenant"})
        if unknown:
            raise AuthFileError(f"unknown key {unknown[0]!r} (only [[tenant]] tables)")
        tables = data.get("tenant", [])
        if not isinstance(tables, list):
            raise AuthFileError("'tenant' must be [[tenant]] tables")
        return cls(_tenant(t, i) for i, t in enumerate(tables))

    def identify(self, token: str) -> Tenant | None:
        """The tenant whose token this is, else None. Every tenant's digest is compared (hmac.compare_digest),
        so the time taken says nothing about which tenant, or how much of a digest, matched."""
        digest, found = token_digest(token), None
        for tenant in self.tenants:
            if hmac.compare_digest(digest, tenant.token_sha256):
                found = tenant
        return found


def _tenant(table: object, index: int) -> Tenant:
    if not isinstance(table, dict):
        raise AuthFileError(f"tenant #{index + 1} is not a table")
    name = table.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise AuthFileError(f"tenant #{index + 1}: 'name' must be 1-64 letters, digits or _.@- (got {name!r})")
    where = f"tenant {name!r}"
    known = ("name", "token_sha256", "rpcs", *QUOTA_KEYS)
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise AuthFileError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    digest = table.get("token_sha256")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise AuthFileError(f"{where}: 'token_sha256' must be 64 hex digits, the sha256 of its token "
                            "(e.g. `printf %s TOKEN | sha256sum`)")
    return Tenant(name, bytes.fromhex(digest), _rpcs(table.get("rpcs"), where), _quotas(table, where))


def _rpcs(value: object, where: str) -> frozenset[str] | None:
    """Full method names of an `rpcs` list of roles, method names ("Score") or full names."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AuthFileError(f"{where}: 'rpcs' must be a list of roles or rpc names")
    out: set[str] = set()
    for entry in value:
        if entry in ROLES:
            out |= ROLES[entry]
            continue
        matches = {m for m in KNOWN_RPCS if m == entry or m == f"/{entry}" or m.rsplit("/", 1)[1] == entry}
        if not matches:
            raise AuthFileError(f"{where}: rpcs: {entry!r} is neither a role ({', '.join(ROLES)}) nor an rpc")
        out |= matches
    return frozenset(out)


def _quotas(table: dict, where: str) -> Quotas:
    values: dict[str, int | float] = {}
    for key in QUOTA_KEYS:
        if key not in table:
            continue
        value = table[key]
        if key == "max_memory_bytes" and isinstance(value, str):
            try:
                value = parse_bytes(value)
            except ValueError as e:
                raise AuthFileError(f"{where}: {key}: {e}") from None
        numeric = (int, float) if key == "max_requests_per_second" else (int,)
        if isinstance(value, bool) or not isinstance(value, numeric) or not value > 0:
            raise AuthFileError(f"{where}: {key} must be a number above 0, got {value!r}")
        values[key] = value
    return Quotas(**values)


class Tenants:
    """A server's current table, replaced whole on reload (SIGHUP) while calls go on with the tenant they have.

    path: the auth file it was read from (None for a shared token or no authentication: nothing to reload).
    """

    def __init__(self, table: TenantTable | None, path: Path | None = None) -> None:
        self.table = table
        """None = no authentication: every call is OPEN_TENANT."""
        self.path = path

    @classmethod
    def from_settings(cls, token: str | None, auth_file: Path | str | None) -> Tenants:
        """From a server's `--token` or `--auth-file` (at most one of them; AuthFileError for a bad file)."""
        if token is not None and auth_file is not None:
            raise ValueError("give a token or an auth file, not both")
        if auth_file is not None:
            return cls(TenantTable.read(auth_file), Path(auth_file))
        return cls(TenantTable.single(token) if token is not None else None)

    def reload(self) -> str:
        """Re-read the auth file; one line saying what happened. A bad file keeps the table in use."""
        if self.path is None:
            return "no auth file to reload"
        try:
            self.table = TenantTable.read(self.path)
        except AuthFileError as e:
            return f"{e}; the tenants read before stay in use"
        return f"auth file {self.path}: {len(self.table.tenants)} tenants"


_CALL_TENANT: ContextVar[Tenant | None] = ContextVar("memlm_call_tenant", default=None)


def enter_tenant(tenant: Tenant) -> None:
    """Make `tenant` the tenant of the running call (its task's context: it ends with the call)."""
    _CALL_TENANT.set(tenant)


def current_tenant() -> Tenant:
    """The tenant of the running call; OPEN_TENANT outside a call (a library use, a server without authentication)."""
    tenant = _CALL_TENANT.get()
    return tenant if tenant is not None else OPEN_TENANT


def current_tenant_name() -> str:
    """The running call's tenant name, NO_TENANT for one refused before it was known, DEFAULT_TENANT otherwise."""
    tenant = _CALL_TENANT.get()
    return DEFAULT_TENANT if tenant is None else tenant.name


NOBODY = Tenant(NO_TENANT, b"", frozenset())
"""Stands for the caller of a call refused for a missing or wrong token: it may call nothing."""


class TenantHoldings:
    """How much of one thing each tenant holds at once (the LM server's engine rows), against one of its quotas.

    quota: the Quotas field that bounds it ("max_engine_rows"). Lives on the server's event loop (no lock).
    """

    def __init__(self, quota: str) -> None:
        if quota not in QUOTA_KEYS:
            raise ValueError(f"{quota!r} is not a quota ({', '.join(QUOTA_KEYS)})")
        self.quota = quota
        self.held: dict[str, int] = {}

    def take(self, tenant: Tenant, n: int) -> str | None:
        """Hold n more for `tenant`; a message naming the quota (and nothing held) when they do not fit, else None."""
        limit, held = getattr(tenant.quotas, self.quota), self.held.get(tenant.name, 0)
        if limit is not None and held + n > limit:
            return f"tenant {tenant.name!r}: {self.quota} {limit} reached"
        self.held[tenant.name] = held + n
        return None

    def give_back(self, tenant: Tenant, n: int) -> None:
        """Release n that `take` held for `tenant`."""
        self.held[tenant.name] -= n
