"""The mesh on one machine: services as child processes on loopback, started and stopped in order.

Engine, tokenizer, detokenizer and gateway each run as a process of their own (services/service_process.py), each
on a free port read from its "listening on" line, the services behind the gateway on loopback whatever LLMMESH_HOST
says. Every link is mutual TLS with the certificates of a credentials directory (services/certs.py fills in what it
lacks), and Redis admits only the user whose password is there. With unix_sockets (as `llmmesh serve` runs it), the
gateway reaches the engines, tokenizer and detokenizer over Unix sockets in a directory private to this user instead,
with the same mutual TLS: each token crosses those links, and a Unix socket spares them the TCP stack. With the KV
store, a `redis-server` (services/redis_server.py) and the kvstore start first, and the engine is given a
--kv-transfer-config that points its connector at the kvstore. `llmmesh serve` and `llmmesh demo`
(services/supervisor.py), tests and benchmarks start the mesh this way.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile

from engine.config import EngineArgs
from mesh import tls
from services.certs import REDIS_USER, make_credentials
from services.redis_server import RedisServer
from services.service_process import ServiceProcess, set_flag

REDIS = "redis-server"  # Redis's name among the mesh's processes


def engine_flags(engine_args: EngineArgs) -> list[str]:
    """EngineArgs back to `llmmesh engine` flags."""
    flags = []
    for f in dataclasses.fields(engine_args):
        value, flag = getattr(engine_args, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):  # --lora-modules a=/x b=/y
            flags += [flag, *value]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def kv_transfer_config(kvstore_address: str, kv_role: str = "kv_both", **options) -> str:
    """The engine's --kv-transfer-config (vLLM's form) for a connector to the kvstore at kvstore_address, in
    kv_role, with any further connector options (load_policy, store_decode_blocks, timeouts)."""
    return json.dumps(
        {
            "kv_connector": "KVStoreConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"kvstore_address": kvstore_address, **options},
        },
        separators=(",", ":"),
    )


class Mesh:
    """Engine, tokenizer, detokenizer and gateway processes on loopback; with kv_store, also a redis-server
    and the kvstore, started before the engine, which is given a --kv-transfer-config pointing at the kvstore.

    service_args: further flags for the services behind the gateway, by service ("engine": every replica,
    "tokenizer", "detokenizer", "kvstore", "sampler"); the gateway's own are gateway_args.

    kv_connector_options: further kv_connector_extra_config for every engine's connector to the kvstore (load_policy,
    store_decode_blocks, timeouts: mesh/kvstore/connector.py).

    prefill_engines > 0 disaggregates prefill (vLLM's P/D through the KV store, which it then needs): that many
    kv_producer engines ("prefill", "prefill-2"...) compute the prompts, and the num_engines others, kv_consumers,
    load their blocks from the kvstore and decode.

    tls_dir: the credentials directory (default: LLMMESH_TLS_DIR, else the state directory's), made on first use;
    insecure_plaintext: no TLS (loopback only), the Redis password still from tls_dir."""

    def __init__(
        self,
        engine_args: EngineArgs,
        gateway_args: list[str] = (),
        port: int = 0,
        echo: bool = False,
        kv_store: bool = False,
        redis_maxmemory: str = "2gb",
        num_engines: int = 1,
        sampler: bool = False,
        env: dict | None = None,
        service_args: dict[str, list[str]] | None = None,
        prefill_engines: int = 0,
        kv_connector_options: dict | None = None,
        tls_dir: str | None = None,
        insecure_plaintext: bool | None = None,
        unix_sockets: bool = False,
    ):
        self.engine_args = engine_args
        self.tls_dir = tls_dir or tls.default_tls_dir()
        if insecure_plaintext is None:
            insecure_plaintext = tls.plaintext_from_env()
        self.insecure_plaintext = insecure_plaintext
        # Every service gets these on top of this process's (LLMMESH_*, OTEL_*), and the mesh's credentials.
        self.env = {
            **(env or {}),
            tls.TLS_DIR_ENV: self.tls_dir,
            tls.PLAINTEXT_ENV: "1" if insecure_plaintext else "",
        }
        self.gateway_args = list(gateway_args)
        self.service_args = dict(service_args or {})
        self.port = port
        self.echo = echo
        self.kv_store = kv_store
        self.redis_maxmemory = redis_maxmemory
        self.kv_connector_options = dict(kv_connector_options or {})
        self.redis: RedisServer | None = None
        self.sampler = sampler  # a sampler service (started before the engines, which sample on it)
        # "engine", then "engine-2"...: replicas behind the one gateway (sharing the KV store, when there is one)
        self.engine_names = ["engine"] + [f"engine-{i}" for i in range(2, num_engines + 1)]
        self.prefill_names = [f"prefill{'' if i == 1 else f'-{i}'}" for i in range(1, prefill_engines + 1)]
        if prefill_engines and not kv_store:
            raise ValueError("prefill engines hand their KV blocks over through the KV store: it must run.")
        if num_engines > 1:  # the gateway routes by where their KV blocks are
            self.engine_args = dataclasses.replace(engine_args, enable_kv_cache_events=True)
        self.services: dict[str, ServiceProcess] = {}
        # The directory of the services' Unix sockets (mkdtemp makes it mode 0700), or None: TCP only.
        self.socket_dir = tempfile.mkdtemp(prefix="llmmesh-") if unix_sockets else None

    def start(self, timeout: float = 600.0) -> str:
        """Start everything and wait until the gateway is serving; returns the gateway's address."""
        self.launch()
        return self.wait(timeout)

    def launch(self, timeout: float = 60.0) -> None:
        """Start the engine, tokenizer and detokenizer (they load at the same time), after Redis and the kvstore
        when the KV store is on; wait() finishes the job."""
        engine_args, flags = self.engine_args, self.service_args
        prefill_args = engine_args
        try:
            make_credentials(self.tls_dir)
            if self.kv_store:
                acl = os.path.join(self.tls_dir, "redis.acl")
                self.redis = RedisServer(maxmemory=self.redis_maxmemory, echo=self.echo, acl_file=acl, user=REDIS_USER)
                password = ["--redis-password-file", os.path.join(self.tls_dir, "redis.password")]
                kvstore = self._start(
                    "kvstore", ["--port", "0", "--redis-url", self.redis.url, *password, *flags.get("kvstore", [])]
                )
                kvstore_address = kvstore.wait_listening(timeout)
                if self.prefill_names:
                    # Its requests' do_remote_prefill makes a consumer load what the producers stored, whatever its
                    # load_policy; the policy still judges what other engines stored.
                    consumer = kv_transfer_config(kvstore_address, "kv_consumer", **self.kv_connector_options)
                    producer = kv_transfer_config(kvstore_address, "kv_producer", **self.kv_connector_options)
                    prefill_args = dataclasses.replace(engine_args, kv_transfer_config=producer)
                    engine_args = dataclasses.replace(engine_args, kv_transfer_config=consumer)
                else:
                    config = kv_transfer_config(kvstore_address, **self.kv_connector_options)
                    engine_args = dataclasses.replace(engine_args, kv_transfer_config=config)
            if self.sampler:
                sampler = self._start("sampler", ["--port", "0", *flags.get("sampler", [])])
                engine_args = dataclasses.replace(engine_args, sampler_address=sampler.wait_listening(timeout))
                prefill_args = dataclasses.replace(prefill_args, sampler_address=engine_args.sampler_address)
        except BaseException:
            self.stop()
            raise
        model = ["--model", engine_args.model]
        for names, args in ((self.engine_names, engine_args), (self.prefill_names, prefill_args)):
            for name in names:
                self._start(name, ["--port", "0", *engine_flags(args), *flags.get("engine", [])], service="engine")
        self._start("tokenizer", ["--port", "0", *model, *flags.get("tokenizer", [])])
        self._start("detokenizer", ["--port", "0", *model, *flags.get("detokenizer", [])])

    def wait(self, timeout: float = 600.0) -> str:
        """Wait for the services, then start the gateway in front of them and wait until it is serving."""
        try:
            for name in (*self.engine_names, *self.prefill_names, "tokenizer", "detokenizer"):
                self.services[name].wait_listening(timeout)
            self._start("gateway", ["--port", str(self.port), *self.gateway_args, *self.backend_flags()])
            return self.services["gateway"].wait_listening(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str], service: str | None = None) -> ServiceProcess:
        service = service or name
        env = self.env
        if service == "engine":
            # The engines tag their KV blocks with the credentials directory's kv-block.key (mesh/kvstore/block_tag.py),
            # one for all of them, unless the environment has LLMMESH_KV_BLOCK_KEY (meshes sharing a Redis).
            env = {**self.engine_threads(), **self.env}
        if service != "gateway" and "--host" not in args:
            # Loopback, even where LLMMESH_HOST says otherwise (a container's every interface): only the gateway is
            # for others to reach.
            args = ["--host", "127.0.0.1", *args]
        if self.socket_dir is not None and service in ("engine", "tokenizer", "detokenizer"):
            args = [*args, "--unix-socket", self.socket_path(name)]
        self.services[name] = ServiceProcess(service, args, self.echo, env)
        return self.services[name]

    def engine_threads(self) -> dict:
        """Engines on one machine split its cores: each gets cores // engines threads (OMP_NUM_THREADS), unless
        OMP_NUM_THREADS is set: engines whose threads outnumber the cores wait on each other at every OpenMP
        barrier, and their steps slow by far more than the sharing itself."""
        num_engines = len(self.engine_names) + len(self.prefill_names)
        if num_engines == 1 or "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in self.env:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // num_engines))}

    def socket_path(self, name: str) -> str:
        return os.path.join(self.socket_dir, f"{name}.sock")

    def backend_address(self, name: str) -> str:
        """Where the gateway reaches a service: its Unix socket, else its TCP address."""
        return f"unix:{self.socket_path(name)}" if self.socket_dir is not None else self.services[name].address

    def backend_flags(self) -> list[str]:
        """The gateway flags that point at this mesh's engines, tokenizer and detokenizer."""
        flags = [
            flag
            for name in (*self.engine_names, "tokenizer", "detokenizer")
            for flag in (f"--{self.services[name].service}", self.backend_address(name))
        ]
        return flags + [
            flag for name in self.prefill_names for flag in ("--prefill-engine", self.backend_address(name))
        ]

    def start_gateway(self, args: list[str], timeout: float = 60.0) -> ServiceProcess:
        """Another gateway (on a free port) in front of the same services, e.g. with other flags."""
        process = ServiceProcess("gateway", ["--port", "0", *args, *self.backend_flags()], self.echo, self.env)
        process.wait_listening(timeout)
        return process

    def restart(self, name: str, timeout: float = 120.0) -> ServiceProcess:
        """Start a service again with its flags, on the port it had (after it died or was killed), and wait
        until it is serving."""
        self.relaunch(name)
        self.services[name].wait_listening(timeout)
        return self.services[name]

    def relaunch(self, name: str) -> None:
        """Start a service (or REDIS) again with its flags, on the ports it had, its /metrics too; kill it first if
        it still runs. The others find it there again: the gateway and engines reconnect on their own. Redis comes
        back empty (the store is a cache), and blocks until it is ready; a service is serving once .listening."""
        if name == REDIS:
            self.redis.start()
            return
        old = self.services[name]
        if old.alive():
            old.kill()
        args = old.args
        if old.address is not None:  # else it died before it served, and its args hold the ports to use
            args = set_flag(args, "--port", old.port)
        if old.metrics_address is not None:
            args = set_flag(args, "--metrics-port", old.metrics_address.rsplit(":", 1)[1])
        self._start(name, args, service=old.service)

    def dead(self) -> list[str]:
        """The services (and REDIS) whose process has exited."""
        dead = [REDIS] if self.redis is not None and not self.redis.alive() else []
        return dead + [name for name, process in self.services.items() if not process.alive()]

    def popen(self, name: str) -> subprocess.Popen:
        """The process of a service, or of REDIS."""
        return (self.redis if name == REDIS else self.services[name]).popen

    @property
    def address(self) -> str:
        return self.services["gateway"].address

    def stop(self, timeout: float = 30.0) -> None:
        """The gateway first (it drains), then the services behind it, then the kvstore and sampler, and Redis last."""
        last = ("kvstore", "sampler")
        tiers = [["gateway"], [name for name in self.services if name not in ("gateway", *last)], list(last)]
        for tier in tiers:
            processes = [self.services[name] for name in tier if name in self.services]
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout)
        if self.redis is not None:
            self.redis.stop()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __enter__(self) -> "Mesh":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
