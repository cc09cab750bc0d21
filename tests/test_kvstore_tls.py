"""The kvstore's link to a Redis on another host: TLS (rediss://) to a real `redis-server` serving TLS alone, with the
ACL user and a client certificate; a Redis whose certificate the given CA did not sign is refused; and plaintext
redis:// off loopback needs --redis-allow-plaintext."""

import shutil

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from test_kvstore import CALL_TIMEOUT, Store, blocks_for, chain, layout

from conftest import NOT_SERVING, SERVING, InProcessService, wait_for_health
from llmmesh.v1 import kvstore_pb2
from services.certs import REDIS_USER, _certificate
from services.cli import build_parser
from services.kvstore_service import KVStoreService, RedisTLS, check_redis_link
from services.redis_server import RedisServer

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def make_ca(directory, name: str) -> tuple:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = _certificate(name, key.public_key(), subject, key, ca=True)
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, subject


def make_leaf(directory, name: str, ca, sans=()) -> tuple[str, str]:
    """A certificate of the CA for name (and the given SANs), with its key: the files' paths."""
    ca_key, ca_subject = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, key.public_key(), ca_subject, ca_key, ca=False, sans=[name, *sans])
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def redis_tls(tmp_path_factory):
    """Redis's CA and its certificates: Redis's own (for 127.0.0.1), a client's, and a Redis certificate of another
    CA."""
    root = tmp_path_factory.mktemp("redis-tls")
    ca, stranger = make_ca(root, "redis-ca"), make_ca(root, "stranger-ca")
    return {
        "ca": str(root / "redis-ca.crt"),
        "server": make_leaf(root, "redis", ca, ["127.0.0.1", "localhost"]),
        "client": make_leaf(root, "kvstore-client", ca),
        "stranger": make_leaf(root, "impostor", stranger, ["127.0.0.1", "localhost"]),
    }


def redis_over_tls(redis_tls, mesh_credentials, auth_clients: bool = True) -> RedisServer:
    cert, key = redis_tls["server"]
    acl = str(mesh_credentials / "redis.acl")
    return RedisServer(
        maxmemory="64mb", acl_file=acl, user=REDIS_USER, tls=(cert, key, redis_tls["ca"]), tls_auth_clients=auth_clients
    )


def kvstore_flags(redis: RedisServer, redis_tls, mesh_credentials, client_cert: bool = True) -> list[str]:
    cert, key = redis_tls["client"]
    flags = ["--redis-url", redis.url, "--redis-password-file", mesh_credentials / "redis.password"]
    flags += ["--redis-ca-file", redis_tls["ca"], "--redis-timeout", "5"]
    return flags + (["--redis-cert-file", cert, "--redis-key-file", key] if client_cert else [])


def test_kvstore_stores_and_loads_blocks_over_tls(redis_tls, mesh_credentials):
    with redis_over_tls(redis_tls, mesh_credentials) as redis:
        assert redis.url.startswith("rediss://")
        with InProcessService("kvstore", kvstore_flags(redis, redis_tls, mesh_credentials), timeout=60) as kvstore:
            wait_for_health(kvstore.address, SERVING)
            store = Store(kvstore.address)
            hashes = chain(40)
            # More than one MGET chunk of the Get's own TLS connection (services/block_reader.py).
            blocks = blocks_for(hashes, nbytes=256 * 1024)
            block_layout = layout(shape=(2, 2, 4, 16, 256))
            assert store.put(blocks, block_layout).num_stored == len(hashes)
            lookup = store.stub.Lookup(
                kvstore_pb2.LookupRequest(fingerprint=block_layout.fingerprint, block_hashes=hashes),
                timeout=CALL_TIMEOUT,
            )
            assert lookup.num_present == len(hashes)
            assert store.get(hashes, block_layout, nbytes=256 * 1024) == list(blocks.items())


@pytest.mark.parametrize("then", ["another-ca", "client-certificates"])
def test_kvstore_refuses_a_redis_its_ca_did_not_sign(redis_tls, mesh_credentials, then):
    """Redis comes back on its port with a certificate of another CA, or asking for client certificates that this
    kvstore has none of: health says NOT_SERVING and every call answers UNAVAILABLE, none reaching Redis."""
    with redis_over_tls(redis_tls, mesh_credentials, auth_clients=then == "another-ca") as redis:
        flags = kvstore_flags(redis, redis_tls, mesh_credentials, client_cert=then == "another-ca")
        with InProcessService("kvstore", flags, timeout=60) as kvstore:
            wait_for_health(kvstore.address, SERVING)
            store = Store(kvstore.address)
            store.put(blocks_for(chain(2)))
            redis.kill()
            if then == "another-ca":
                redis.tls = (*redis_tls["stranger"], redis_tls["ca"])
            redis.tls_auth_clients = True
            redis.start()
            wait_for_health(kvstore.address, NOT_SERVING)
            for call in (lambda: store.put(blocks_for(chain(2))), lambda: store.get(chain(2))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
                assert f"redis at {redis.address}/0 is unreachable" in e.value.details()
                if then == "another-ca":
                    assert "certificate verify failed" in e.value.details()


def kvstore_args(*flags: str):
    return build_parser().parse_args(["kvstore", *flags])


@pytest.mark.parametrize("host", ["redis", "10.0.0.7", "[fd00::7]"])
def test_plaintext_redis_off_loopback_needs_the_flag(host):
    url = f"redis://{REDIS_USER}@{host}:6379/0"
    with pytest.raises(ValueError, match="--redis-allow-plaintext"):
        check_redis_link(kvstore_args("--redis-url", url))
    check_redis_link(kvstore_args("--redis-url", url, "--redis-allow-plaintext"))
    for loopback in ("127.0.0.1", "localhost", "[::1]"):
        check_redis_link(kvstore_args("--redis-url", f"redis://{loopback}:6379/0"))
    check_redis_link(kvstore_args("--redis-url", f"rediss://{host}:6380/0", "--redis-ca-file", "ca.crt"))


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--redis-url", "rediss://redis:6380/0", "--redis-cert-file", "c.crt"], "go together"),
        (["--redis-url", "redis://127.0.0.1:6379/0", "--redis-ca-file", "ca.crt"], "--redis-ca-file is for TLS"),
        (["--redis-url", "http://redis:6379/0"], "rediss://HOST:PORT/DB"),
    ],
)
def test_redis_tls_flags_that_disagree_are_refused(flags, refusal):
    with pytest.raises(ValueError, match=refusal):
        check_redis_link(kvstore_args(*flags))


def test_a_missing_redis_ca_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="--redis-ca-file.*No such file"):
        KVStoreService("rediss://127.0.0.1:6380/0", tls=RedisTLS(ca_file=str(tmp_path / "none.crt")))
