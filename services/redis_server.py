"""`redis-server` as a child process, the KV store's Redis in `llmmesh serve` and in tests."""

import os
import shutil
import subprocess
import tempfile
import threading
import time

from services.service_process import free_port


class RedisServer:
    """`redis-server` as a child process for the KV store: on 127.0.0.1 only, on a free port (or the one given),
    with a temporary directory of its own, no persistence, and `maxmemory` with allkeys-lru eviction (a cache).

    start() (called on construction) returns once it accepts connections; kill() and start() again bring it
    back on the same port, empty, as a restarted Redis would be.

    acl_file: Redis's users (`llmmesh certs` writes one, redis.acl, whose user `user` alone may run commands, with the
    password of redis.password); url then names the user, and the password stays out of every command line.

    tls: (certificate, key, CA certificate) files: it then speaks TLS alone (rediss://), and with tls_auth_clients
    admits only clients presenting a certificate of that CA."""

    READY = "Ready to accept connections"

    def __init__(
        self,
        port: int = 0,
        maxmemory: str = "2gb",
        echo: bool = False,
        acl_file: str | None = None,
        user: str | None = None,
        tls: tuple[str, str, str] | None = None,
        tls_auth_clients: bool = False,
    ):
        self.executable = shutil.which("redis-server")
        if self.executable is None:
            raise RuntimeError(
                "redis-server is not installed: `make setup` installs Debian's redis-server when run as "
                "root (or: apt-get install redis-server), or run without the KV store (--no-kv-store)"
            )
        self.port = port
        self.maxmemory = maxmemory
        self.echo = echo
        self.acl_file, self.user = acl_file, user
        self.tls, self.tls_auth_clients = tls, tls_auth_clients
        self.dir = tempfile.mkdtemp(prefix="llmmesh-redis-")
        self.popen: subprocess.Popen | None = None
        try:
            self.start()
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.user + '@' if self.user else ''}{self.address}/0"

    def start(self, timeout: float = 30.0) -> None:
        """Start it (on a free port the first time) and wait until it accepts connections."""
        if self.alive():
            return
        for _ in range(5):
            chosen = self.port or free_port()
            if self._launch(chosen, timeout):
                self.port = chosen
                return
            if self.port:  # a port given, or the one it had: taken
                break
        raise RuntimeError(
            f"redis-server did not start on 127.0.0.1:{self.port or 'a free port'} (exit code "
            f"{self.popen.returncode}); run it with echo=True to see its log"
        )

    def _launch(self, port: int, timeout: float) -> bool:
        ready = threading.Event()
        self.popen = subprocess.Popen(
            [
                self.executable,
                *(self._tls_args(port) if self.tls else ["--port", str(port)]),
                "--bind",
                "127.0.0.1",
                "--protected-mode",
                "yes",
                "--dir",
                self.dir,
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                "",
                "--maxmemory",
                self.maxmemory,
                "--maxmemory-policy",
                "allkeys-lru",
                *(["--aclfile", os.path.abspath(self.acl_file)] if self.acl_file else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read_log, args=(self.popen, ready), name="redis-log", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.popen.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server on 127.0.0.1:{port} was not ready after {timeout:.0f} s")
        return True

    def _tls_args(self, port: int) -> list[str]:
        cert, key, ca = (os.path.abspath(path) for path in self.tls)
        auth = "yes" if self.tls_auth_clients else "no"
        files = ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca]
        return ["--port", "0", "--tls-port", str(port), *files, "--tls-auth-clients", auth]

    def _read_log(self, popen: subprocess.Popen, ready: threading.Event) -> None:
        with popen.stdout:
            for line in popen.stdout:
                if self.READY in line:
                    ready.set()
                if self.echo:
                    print(f"[redis] {line}", end="", flush=True)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: as if it crashed (its data is gone; start() brings it back on the same port)."""
        if self.alive():
            self.popen.kill()
        if self.popen is not None:
            self.popen.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after timeout), and its directory removed."""
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
