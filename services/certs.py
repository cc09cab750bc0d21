"""`llmmesh certs`: a mesh's credentials directory, made once and never overwritten.

It holds a private CA (ca.crt, ca.key), one certificate per identity of mesh/tls.py signed by it (<identity>.crt and
<identity>.key, the SAN <identity>.llmmesh; the gateway's also names loopback and any --host given, since clients
reach its public port by address), the KV store's Redis user: its password (redis.password) and Redis's ACL
file (redis.acl, which holds only the password's SHA-256), and the key the engines tag their KV blocks with
(kv-block.key, mesh/kvstore/block_tag.py). Keys and the password are written mode 0600.
`llmmesh serve` runs the same into its state directory on first start; compose runs it as a one-shot step.
"""

import datetime
import hashlib
import ipaddress
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from engine.config.utils import add_cli_args
from mesh.kvstore.block_tag import KEY_FILE, new_block_key
from mesh.tls import IDENTITIES, default_tls_dir, san
from services.settings import CertsFlags

REDIS_USER = "llmmesh"
VALID_DAYS = 825  # the longest validity browsers accept for a leaf; rotate before it ends (docs/security.md)
CA_VALID_DAYS = 3650


def _write(path: Path, data: bytes, secret: bool) -> None:
    # O_EXCL: material already there is never overwritten, even by a concurrent run.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(subject: str, public_key, issuer: x509.Name, signing_key, ca: bool, sans=(), days=VALID_DAYS):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a peer's clock a little behind still accepts it
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if ca:
        usage = dict(key_cert_sign=True, crl_sign=True, digital_signature=False)
    else:
        usage = dict(key_cert_sign=False, crl_sign=False, digital_signature=True)
        eku = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # each service is both
        builder = builder.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
        names = []
        for name in sans:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                names.append(x509.DNSName(name))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    builder = builder.add_extension(
        x509.KeyUsage(
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
            **usage,
        ),
        critical=True,
    )
    return builder.sign(signing_key, hashes.SHA256())


def make_credentials(directory, hosts: list[str] = (), ca_name: str = "llmmesh mesh CA") -> list[str]:
    """Fill a credentials directory with whatever it lacks; returns the files written. A directory with a CA
    certificate but not its key cannot sign new certificates: it is left as it is, and that is an error."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    written = []
    ca_cert_path, ca_key_path = directory / "ca.crt", directory / "ca.key"
    if not ca_cert_path.exists():
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
        ca_cert = _certificate(ca_name, ca_key.public_key(), name, ca_key, ca=True, days=CA_VALID_DAYS)
        _write(ca_key_path, _key_pem(ca_key), secret=True)
        _write(ca_cert_path, ca_cert.public_bytes(serialization.Encoding.PEM), secret=False)
        written += [ca_key_path.name, ca_cert_path.name]
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    for identity in IDENTITIES:
        cert_path, key_path = directory / f"{identity}.crt", directory / f"{identity}.key"
        if cert_path.exists() and key_path.exists():
            continue
        if not ca_key_path.exists():
            raise ValueError(f"{directory} has no ca.key to sign {cert_path.name} with: give its certificate by hand")
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        key = ec.generate_private_key(ec.SECP256R1())
        # The gateway's public port is reached by address: loopback and the given hosts are names of it too.
        sans = [san(identity), *(["localhost", "127.0.0.1", "::1", *hosts] if identity == "gateway" else [])]
        cert = _certificate(san(identity), key.public_key(), ca_cert.subject, ca_key, ca=False, sans=sans)
        for path in (cert_path, key_path):
            path.unlink(missing_ok=True)  # half a pair (an interrupted run): made again whole
        _write(key_path, _key_pem(key), secret=True)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), secret=False)
        written += [key_path.name, cert_path.name]
    password_path, acl_path = directory / "redis.password", directory / "redis.acl"
    if not password_path.exists():
        _write(password_path, secrets.token_hex(32).encode(), secret=True)
        written.append(password_path.name)
    if not acl_path.exists():
        # Readable by Redis's own user (the hash of 256 random bits discloses nothing); `default` is off, so a
        # client without the password can run no command.
        digest = hashlib.sha256(password_path.read_bytes().strip()).hexdigest()
        _write(acl_path, f"user default off\nuser {REDIS_USER} on #{digest} ~* &* +@all\n".encode(), secret=False)
        written.append(acl_path.name)
    block_key_path = directory / KEY_FILE
    if not block_key_path.exists():
        _write(block_key_path, new_block_key().encode(), secret=True)
        written.append(block_key_path.name)
    return written


def redis_password(directory) -> str:
    return (Path(directory) / "redis.password").read_text().strip()


def run_certs(args) -> None:
    directory = args.dir or default_tls_dir()
    written = make_credentials(directory, args.host or [])
    print(
        f"llmmesh certs: wrote {', '.join(written)} to {directory}"
        if written
        else f"llmmesh certs: {directory} is whole"
    )


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser(
        "certs",
        help="make a mesh's private CA, a certificate per service and the Redis user's password (missing ones only)",
    )
    add_cli_args(p, CertsFlags, grouped=False)
    p.set_defaults(func=run_certs)
