"""One service as a child process: `llmmesh <service> <args>`, its address read from its "listening on" line.
`llmmesh serve` (services/supervisor.py), the mesh on one machine (services/local_mesh.py), tests and benchmarks
start services this way."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

LISTENING = re.compile(r"llmmesh (\w+) listening on (\S+)")
METRICS = re.compile(r"llmmesh (\w+) metrics on (\S+)")  # with --metrics-port (services.telemetry)


class ServiceProcess:
    """`llmmesh <service> <args>` as a child process; its address comes from its listening line."""

    def __init__(self, service: str, args: list[str], echo: bool = False, env: dict | None = None):
        self.service = service
        self.args = list(args)
        self.address: str | None = None
        self.metrics_address: str | None = None  # HOST:PORT of its Prometheus /metrics, once it says
        self.listening = threading.Event()
        self.echo = echo
        # Its own session: a Ctrl-C at the terminal reaches `serve`, which stops the services in order.
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", service, *args],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=None if env is None else {**os.environ, **env},  # env: variables on top of this process's
        )
        threading.Thread(target=self._read_stdout, name=f"{service}-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        with self.popen.stdout:
            for line in self.popen.stdout:
                match = LISTENING.search(line)
                if match and match.group(1) == self.service and self.address is None:
                    self.address = match.group(2)
                    self.listening.set()
                    continue
                if (metrics := METRICS.search(line)) and metrics.group(1) == self.service:
                    self.metrics_address = metrics.group(2)
                if self.echo:
                    print(f"[{self.service}] {line}", end="", flush=True)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.listening.wait(0.1):
            if self.popen.poll() is not None:
                raise RuntimeError(f"the {self.service} exited with code {self.popen.returncode} before it was serving")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {self.service} was not serving after {timeout:.0f} s")
        return self.address

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the service drains), then SIGKILL after timeout."""
        self.terminate()
        self.wait(timeout)

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Wait for the process to exit; SIGKILL it after timeout."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


def exit_status(returncode: int) -> str:
    """A process's exit as words: "exit code 1", "killed by SIGKILL"."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def set_flag(args: list[str], flag: str, value) -> list[str]:
    """args with flag set to value: in place of its last occurrence (the one argparse keeps), else appended."""
    if flag not in args:
        return [*args, flag, str(value)]
    i = len(args) - 1 - args[::-1].index(flag)
    return [*args[: i + 1], str(value), *args[i + 2 :]]


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before it is used)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
