"""A service's Unix socket (--unix-socket), as `llmmesh serve` gives one to each service behind the gateway: the same
mutual TLS as the service's TCP port, its callers' identities checked the same, in a directory private to the mesh's
user that no other user may even connect through."""

import os
import shutil
import subprocess
import tempfile

import grpc
import pytest

from conftest import InProcessService, mesh_channel
from llmmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mesh import tls


@pytest.fixture(scope="module")
def private_dir():
    # Under /tmp itself (not pytest's private tree), so that only this directory's mode keeps other users out.
    path = tempfile.mkdtemp(prefix="llmmesh-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer(mesh_credentials, private_dir):
    socket = os.path.join(private_dir, "tokenizer.sock")
    with InProcessService("tokenizer", ["--unix-socket", socket]) as service:
        yield service, socket


def tokenize(channel) -> list[int]:
    return list(
        tokenizer_pb2_grpc.TokenizerStub(channel)
        .Tokenize(tokenizer_pb2.TokenizeRequest(text="Hi"), timeout=10)
        .token_ids
    )


def test_the_socket_answers_the_gateway_over_mutual_tls(tokenizer):
    service, socket = tokenizer
    with tls.channel(f"unix:{socket}", "tokenizer", tls.credentials_from_env("gateway")) as channel:
        over_socket = tokenize(channel)
    with mesh_channel(service.address, "gateway") as channel:
        assert tokenize(channel) == over_socket != []


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_a_peer_without_the_mesh_certificate_or_of_another_identity_is_refused(tokenizer, where):
    service, socket = tokenizer
    address = service.address if where == "tcp" else f"unix:{socket}"
    with grpc.insecure_channel(address) as channel:  # no certificate: the handshake fails
        with pytest.raises(grpc.RpcError) as e:
            tokenize(channel)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate of the mesh, of an identity that may not call the tokenizer: refused by name.
    with tls.channel(address, "tokenizer", tls.credentials_from_env("engine")) as channel:
        with pytest.raises(grpc.RpcError) as e:
            tokenize(channel)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "engine.llmmesh" in e.value.details()


def test_a_socket_in_a_directory_others_may_enter_is_refused(mesh_credentials, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    socket = str(shared / "tokenizer.sock")
    with pytest.raises(RuntimeError) as e:
        InProcessService("tokenizer", ["--unix-socket", socket])
    assert "private to it" in str(e.value.__cause__)
    with pytest.raises(ValueError, match="private to it"):
        tls.channel(f"unix:{socket}", "tokenizer", tls.credentials_from_env("gateway"))


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_neither_the_gateway_nor_serve_takes_a_unix_socket(command, capsys):
    from services.cli import build_parser

    with pytest.raises(SystemExit):  # the gateway's callers are not of its host; serve gives each service its own
        build_parser().parse_args([command, "--unix-socket", "/tmp/x.sock"])
    assert "unrecognized arguments: --unix-socket" in capsys.readouterr().err


SYSTEM_PYTHON = "/usr/bin/python3"  # another user cannot run the suite's own, under root's home


@pytest.mark.skipif(os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs root and a system python")
def test_another_user_cannot_connect(tokenizer):
    _, socket = tokenizer
    connect = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({socket!r})"
    denied = subprocess.run([SYSTEM_PYTHON, "-S", "-c", connect], user=65534, capture_output=True, text=True)
    assert denied.returncode != 0 and "PermissionError" in denied.stderr
    allowed = subprocess.run([SYSTEM_PYTHON, "-S", "-c", connect], capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stderr
