"""Mutual TLS between the mesh's services: the credentials of every server and channel, and who may call whom.

A mesh's credentials directory (services/certs.py makes one) holds its private CA's certificate (ca.crt) and, for each
service, a certificate the CA signed whose SAN is the service's identity (engine.llmmesh, ...) with its key
(engine.crt, engine.key). A server accepts only peers that present a certificate of that CA, and answers a call only
when the peer's identity may call that gRPC service (CALLERS); a channel presents its process's certificate and checks
that the server's names the service it meant to reach.

Services of one host may also reach each other over a Unix socket (--unix-socket) in a directory only the mesh's user
can enter: the same mutual TLS and the same identities as on their TCP port, the socket's directory keeping every other
user from even connecting.

The directory comes from --tls-dir (LLMMESH_TLS_DIR); without one, plaintext needs --insecure-plaintext
(LLMMESH_INSECURE_PLAINTEXT) and binds loopback only. The engine's plug-ins (the KV connector, the remote sampler) read
the same variables: they run inside an engine, whose identity they present.
"""

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from mesh.grpc_policy import CHANNEL_OPTIONS

DOMAIN = "llmmesh"
# Every identity the mesh's CA certifies. The router is a vLLM-protocol router (smg) in front of the engines.
IDENTITIES = ("gateway", "engine", "tokenizer", "detokenizer", "kvstore", "sampler", "router")

# Which identities may call each gRPC service (rendered into docs/security.md). Health and reflection answer any peer
# the CA certified; the gateway's public llmmesh.v1.Gateway answers clients (its own TLS: --tls-cert, --tls-ca).
CALLERS = {
    "llmmesh.v1.Engine": ("gateway",),
    "vllm.grpc.engine.VllmEngine": ("router",),
    "llmmesh.v1.Tokenizer": ("gateway",),
    "llmmesh.v1.Detokenizer": ("gateway",),
    "llmmesh.v1.KVStore": ("engine",),
    "llmmesh.v1.Sampler": ("engine",),
}
ANY_PEER = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")

TLS_DIR_ENV = "LLMMESH_TLS_DIR"
PLAINTEXT_ENV = "LLMMESH_INSECURE_PLAINTEXT"


def san(identity: str) -> str:
    """The DNS name in an identity's certificate: engine -> engine.llmmesh."""
    return f"{identity}.{DOMAIN}"


def default_state_dir() -> Path:
    """Where `llmmesh serve` keeps what it generates: $LLMMESH_STATE_DIR, else $XDG_STATE_HOME/llmmesh."""
    if state := os.environ.get("LLMMESH_STATE_DIR"):
        return Path(state)
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / DOMAIN


def default_tls_dir() -> str:
    return os.environ.get(TLS_DIR_ENV) or str(default_state_dir() / "tls")


def plaintext_from_env() -> bool:
    return os.environ.get(PLAINTEXT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def unix_path(address: str) -> str | None:
    """The path of a unix: address (unix:PATH or unix://ABSOLUTE_PATH), else None."""
    if not address.startswith("unix:"):
        return None
    return address[len("unix://") :] if address.startswith("unix://") else address[len("unix:") :]


def check_private_socket(path: str) -> None:
    """A socket of the mesh must lie in a directory of this user's that no one else can enter: its permissions are
    the only thing that admits a peer on it."""
    directory = os.path.dirname(os.path.abspath(path))
    st = os.stat(directory)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"the Unix socket {path} must be in a directory owned by this user and private to it (mode 0700), "
            f"not {directory} (owner uid {st.st_uid}, mode {st.st_mode & 0o777:04o})"
        )


def is_loopback(host: str) -> bool:
    if host in ("localhost", "unix") or host.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_plaintext_host(host: str) -> None:
    """Plaintext listens on loopback only: anyone who reaches another interface could call in unauthenticated."""
    if not is_loopback(host):
        raise ValueError(
            f"--insecure-plaintext binds loopback only, not --host {host}: serve mutual TLS (--tls-dir) to listen "
            "on other interfaces"
        )


@dataclass(frozen=True)
class MeshCredentials:
    """One identity's files in a credentials directory."""

    tls_dir: str
    identity: str

    def read(self, name: str) -> bytes:
        path = Path(self.tls_dir) / name
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise ValueError(
                f"no {path}: make the mesh's certificates with `llmmesh certs --dir {self.tls_dir}`, or run with "
                "--insecure-plaintext on loopback"
            ) from None

    def ca(self) -> bytes:
        return self.read("ca.crt")

    def key_pair(self) -> tuple[bytes, bytes]:
        return self.read(f"{self.identity}.key"), self.read(f"{self.identity}.crt")

    def server_credentials(self) -> grpc.ServerCredentials:
        """The server's certificate; peers must present one the mesh's CA signed."""
        return grpc.ssl_server_credentials([self.key_pair()], root_certificates=self.ca(), require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        key, cert = self.key_pair()
        return grpc.ssl_channel_credentials(root_certificates=self.ca(), private_key=key, certificate_chain=cert)


def channel_options(server: str) -> list:
    """The channel options to reach `server` (an identity): the mesh's policy, and the name its certificate must
    carry (the address alone, an IP or a container name, is not what the mesh's certificates name)."""
    return CHANNEL_OPTIONS + [("grpc.ssl_target_name_override", san(server))]


def credentials_from_env(identity: str) -> MeshCredentials | None:
    """This process's credentials from LLMMESH_TLS_DIR (or the default directory); None under plaintext."""
    return None if plaintext_from_env() else MeshCredentials(default_tls_dir(), identity)


def _check_unix(address: str) -> None:
    if (path := unix_path(address)) is not None:
        check_private_socket(path)


def channel(address: str, server: str, credentials: MeshCredentials | None) -> grpc.Channel:
    """A blocking channel to `server` (an identity) at address (HOST:PORT, or unix:PATH in a private directory):
    mutual TLS, or plaintext when credentials is None."""
    _check_unix(address)
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, credentials.channel_credentials(), options=channel_options(server))


def aio_channel(address: str, server: str, credentials: MeshCredentials | None) -> grpc.aio.Channel:
    """channel() for asyncio."""
    _check_unix(address)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials.channel_credentials(), options=channel_options(server))


def peer_identity(auth_context: dict) -> str | None:
    """The mesh identity of a peer's certificate (its SAN under DOMAIN), or None."""
    for name in auth_context.get("x509_subject_alternative_name", []):
        name = name.decode() if isinstance(name, bytes) else name
        if name.endswith("." + DOMAIN):
            return name[: -len(DOMAIN) - 1]
    return None


def refusal(service: str, identity: str | None) -> str | None:
    """Why a peer of this identity may not call this gRPC service; None when it may."""
    if service in ANY_PEER:
        return None
    allowed = CALLERS.get(service, ())
    if identity in allowed:
        return None
    who = f"the identity {san(identity)}" if identity else "a peer with no mesh identity"
    callers = ", ".join(san(i) for i in allowed) or "no service of the mesh"
    return f"{who} may not call {service} (its callers: {callers})"


def callers_table() -> str:
    """CALLERS as the Markdown table of docs/security.md."""
    rows = ["| gRPC service | identities that may call it |", "| --- | --- |"]
    rows += [f"| `{service}` | {', '.join(f'`{san(i)}`' for i in callers)} |" for service, callers in CALLERS.items()]
    rows += [f"| `{service}` | any certificate of the mesh's CA |" for service in ANY_PEER]
    return "\n".join(rows) + "\n"
