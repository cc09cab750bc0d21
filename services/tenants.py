"""Tenants: who an API key belongs to, what it may spend, and the cache salt that keeps tenants apart.

The gateway's keys file (--api-keys-file, JSON or TOML) lists each key by its SHA-256, never the key itself:

    [[keys]]
    sha256 = "9f86d0..."          # sha256 of the key, hex
    tenant = "acme"
    requests_per_second = 5       # optional: a token bucket of one second's requests
    tokens_per_minute = 100000    # optional: a token bucket of one minute's prompt and completion tokens

(JSON: {"keys": [{...}, ...]}.) A tenant may have several keys; its limits are the tenant's, shared by its keys,
so every entry of a tenant must give the same ones. A key from LLMMESH_API_KEY alone is the tenant "default" with
no rate limits.

Every request of a tenant carries the tenant in its cache salt (tenant_salt): the engines' prefix cache, the
kvstore and the gateway's routing index key blocks by it, so no tenant hits, loads or is routed by another's
blocks, and `cached_tokens` counts its own prefixes alone. A client's cache_salt only narrows sharing within its
tenant.
"""

import dataclasses
import hashlib
import hmac
import json
import math
import os
import re
import time
import tomllib
from pathlib import Path

import grpc

from services.errors import RequestError

DEFAULT_TENANT = "default"  # the tenant of the LLMMESH_API_KEY key
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # no "/": it separates a tenant from its adapters' names
MAX_KEYS_FILE_BYTES = 1 << 20
LIMIT_FIELDS = ("requests_per_second", "tokens_per_minute")


class TokenBucket:
    """`rate` units a second, up to `capacity` saved; take() spends them, or says how long until they are there.
    Tokens charged after the fact (charge) may take it below zero: later requests then wait for the debt."""

    def __init__(self, rate: float, capacity: float, clock=time.monotonic):
        self.rate, self.capacity, self.clock = rate, capacity, clock
        self.level = capacity
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, amount: float) -> float:
        """Spend `amount` now and return 0, or spend nothing and return the seconds until it could be spent
        (math.inf when it is above the capacity)."""
        self._refill()
        if amount > self.capacity:
            return math.inf
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def charge(self, amount: float) -> None:
        self._refill()
        self.level -= amount


@dataclasses.dataclass
class Tenant:
    name: str
    requests_per_second: float | None = None
    tokens_per_minute: float | None = None

    def __post_init__(self):
        self.requests = None
        self.tokens = None
        if self.requests_per_second is not None:
            self.requests = TokenBucket(self.requests_per_second, max(1.0, self.requests_per_second))
        if self.tokens_per_minute is not None:
            self.tokens = TokenBucket(self.tokens_per_minute / 60.0, self.tokens_per_minute)

    def admit(self, context) -> None:
        """One more request of this tenant, within its requests_per_second; else RESOURCE_EXHAUSTED."""
        if self.requests is not None:
            wait = self.requests.take(1)
            if wait:
                raise rate_limited(context, self.name, "requests_per_second", self.requests_per_second, wait)

    def take_tokens(self, context, num_tokens: int) -> None:
        """A prompt's tokens, within tokens_per_minute; else RESOURCE_EXHAUSTED."""
        if self.tokens is not None:
            wait = self.tokens.take(num_tokens)
            if wait:
                raise rate_limited(context, self.name, "tokens_per_minute", self.tokens_per_minute, wait, num_tokens)

    def charge_tokens(self, num_tokens: int) -> None:
        """Tokens generated: known only once generated, they are paid for by the tenant's next requests."""
        if self.tokens is not None:
            self.tokens.charge(num_tokens)


def rate_limited(context, tenant: str, limit: str, value: float, wait: float, num_tokens: int = 0) -> RequestError:
    """RESOURCE_EXHAUSTED naming the limit, with the seconds to wait in the message and in the trailing metadata's
    retry-after (a request that could never fit has none)."""
    if math.isinf(wait):
        return RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"tenant {tenant!r}: a prompt of {num_tokens} tokens is over its {limit} ({value:g}); it never fits",
        )
    retry_after = f"{max(wait, 0.001):.3f}"
    context.set_trailing_metadata((("retry-after", retry_after),))
    return RequestError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"tenant {tenant!r}: over its {limit} ({value:g}); retry after {retry_after} s",
    )


def tenant_salt(tenant: "Tenant | None", cache_salt: str) -> str:
    """The cache salt the engines get: the tenant's, narrowed by the client's own. Without tenants (no keys) the
    client's salt as it is."""
    if tenant is None:
        return cache_salt
    return hashlib.sha256(f"{tenant.name}\0{cache_salt}".encode()).hexdigest()


class Tenants:
    """The keys the gateway takes (by their SHA-256) and the tenant of each. With no keys, access is open and
    requests have no tenant."""

    def __init__(self, keys: dict[bytes, Tenant] | None = None):
        self.keys = keys or {}

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, metadata) -> Tenant | None:
        """The caller's tenant from its `authorization: Bearer KEY` metadata; UNAUTHENTICATED without a known key."""
        if not self.keys:
            return None
        given = dict(metadata or ()).get("authorization", "")
        key = given.removeprefix("Bearer ") if given.startswith("Bearer ") else ""
        digest = hashlib.sha256(key.encode()).digest()
        # Every key compared, in constant time each: which one matched, if any, is not in the timing.
        found = None
        for known, tenant in self.keys.items():
            if hmac.compare_digest(digest, known) and key:
                found = tenant
        if found is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "authorization metadata must be 'Bearer <api key>'")
        return found

    @classmethod
    def from_key(cls, api_key: str) -> "Tenants":
        return cls({hashlib.sha256(api_key.encode()).digest(): Tenant(DEFAULT_TENANT)})

    @classmethod
    def from_file(cls, path: str) -> "Tenants":
        """A keys file, JSON or TOML (by its suffix: .json, else TOML); ValueError naming the entry and field."""
        file = Path(path)
        try:
            if file.stat().st_size > MAX_KEYS_FILE_BYTES:
                raise ValueError(f"api_keys_file: larger than {MAX_KEYS_FILE_BYTES} bytes.")
            text = file.read_text()
            data = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"api_keys_file {path!r}: cannot read it: {e}") from None
        entries = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"api_keys_file {path!r}: needs a non-empty list 'keys' of entries.")
        keys: dict[bytes, Tenant] = {}
        tenants: dict[str, Tenant] = {}
        for i, entry in enumerate(entries):
            tenant = parse_entry(f"api_keys_file keys[{i}]", entry)
            digest = bytes.fromhex(entry["sha256"])
            if digest in keys:
                raise ValueError(f"api_keys_file keys[{i}].sha256: the same key is listed twice.")
            known = tenants.setdefault(tenant.name, tenant)
            if dataclasses.astuple(known) != dataclasses.astuple(tenant):
                raise ValueError(
                    f"api_keys_file keys[{i}]: tenant {tenant.name!r} has other limits in an earlier entry; a "
                    "tenant's limits are one, shared by its keys."
                )
            keys[digest] = known
        return cls(keys)


def parse_entry(where: str, entry) -> Tenant:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a table of sha256, tenant and limits.")
    unknown = sorted(set(entry) - {"sha256", "tenant", *LIMIT_FIELDS})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: sha256, tenant, {', '.join(LIMIT_FIELDS)}.")
    digest = entry.get("sha256")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        raise ValueError(f"{where}.sha256: the key's SHA-256 as 64 hex digits (never the key itself).")
    name = entry.get("tenant")
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ValueError(f"{where}.tenant: 1 to 64 of A-Z a-z 0-9 _ . - , got {name!r}.")
    limits = {}
    for field in LIMIT_FIELDS:
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{where}.{field}: a number above 0, got {value!r}.")
        limits[field] = value
    return Tenant(name, **limits)


def refuse_key_on_command_line(args) -> None:
    """A key comes from the environment (LLMMESH_API_KEY) or a file, never a command line: /proc shows every
    process's command line to every local user."""
    if args.api_key and args.api_key != os.environ.get("LLMMESH_API_KEY"):
        raise ValueError(
            "api_key: a key on the command line is refused, as every local user can read it there; give it as "
            "LLMMESH_API_KEY (or the gateway's keys in --api-keys-file)."
        )


def load_tenants(args) -> Tenants:
    """The gateway's tenants from --api-keys-file, or the one key of LLMMESH_API_KEY; none: open access."""
    if args.api_keys_file and args.api_key:
        raise ValueError("give the gateway's keys in api_keys_file or as LLMMESH_API_KEY, not both.")
    if args.api_keys_file:
        return Tenants.from_file(args.api_keys_file)
    if args.api_key:
        return Tenants.from_key(args.api_key)
    return Tenants()


# ---- LoRA adapters per tenant ----------------------------------------------------------------------------------
# A tenant's adapter is loaded on the engines as "~TENANT/NAME": tenants cannot name, see or unload another's. An
# adapter whose name does not start with "~" is the operator's (--lora-modules), served to every tenant, and
# unloaded by none. A tenant's adapter directories are under --lora-root/TENANT/.

TENANT_ADAPTER_PREFIX = "~"


def engine_adapter_name(tenant: "Tenant | None", lora_name: str) -> str:
    return lora_name if tenant is None else f"{TENANT_ADAPTER_PREFIX}{tenant.name}/{lora_name}"


def visible_adapters(tenant: "Tenant | None", engine_names) -> dict[str, str]:
    """The adapters a tenant may use, by the name it knows them by -> the engines' name: its own and the
    operator's."""
    if tenant is None:
        return {name: name for name in engine_names}
    own = engine_adapter_name(tenant, "")
    visible = {name: name for name in engine_names if not name.startswith(TENANT_ADAPTER_PREFIX)}
    visible.update({name.removeprefix(own): name for name in engine_names if name.startswith(own)})
    return visible


def engine_adapter_path(tenant: "Tenant | None", lora_path: str) -> str:
    """Where the engines look for a tenant's adapter: TENANT/PATH under their --lora-root. A tenant's path is
    relative and stays inside its directory (ValueError); without tenants, the path as it is (the engine judges
    it against its --lora-root)."""
    if tenant is None:
        return lora_path
    parts = lora_path.replace("\\", "/").split("/")
    if lora_path.startswith("/") or ".." in parts or not lora_path:
        raise ValueError("lora_path: a path relative to the tenant's adapter directory, without '..'.")
    return f"{tenant.name}/{lora_path}"
