"""The multiprocess executor: one worker per tensor-parallel rank.

Rank 0's worker runs in the engine core's process and does everything a lone worker does (the KV cache's
sizing, the batch, sampling); ranks 1..N-1 are processes of their own (`python -m engine.executor.multiproc
--rank R`), started here or by hand on another host. Rank 0 drives them through its model: before each call of
the model (a forward pass, or logits of some hidden rows) it sends the call's inputs to every other rank, which
makes the same call on its shard, so the ranks meet in the same collectives in the same order. Only rank 0's
sampled tokens exist; the scheduler runs once, in the engine core.

The calls cross a TCP connection from each rank to rank 0 (at MASTER_PORT + 1) as engine.executor.messages
encodes them, never pickled. A connection that closes is a rank gone: the engine ends with an error naming it
(ExecutorDeadError), and a step blocked in a collective with a rank that stopped fails after the group's
timeout instead of hanging.
"""

import argparse
import dataclasses
import hmac
import json
import logging
import os
import secrets
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from engine.config import EngineArgs
from engine.distributed.parallel_state import destroy_distributed, init_distributed
from engine.executor.messages import decode, encode
from engine.executor.uniproc import ExecutorDeadError, UniProcExecutor
from engine.models.config import ModelConfig
from engine.models.files import load_config
from engine.models.llama import check_tensor_parallel_size
from engine.worker.worker import Worker, resolve_device

logger = logging.getLogger("llmmesh.engine")

# Seconds rank 0 waits for every other rank to connect: ranks started by hand elsewhere may take a while.
CONNECT_TIMEOUT_S = 300.0
# Ranks of this host that the executor starts itself (comma-separated); unset: all of 1..N-1. The others are
# started by hand (see docs/deployment.md) with the same $LLMMESH_TP_TOKEN.
LOCAL_RANKS_ENV = "LLMMESH_TP_LOCAL_RANKS"
TOKEN_ENV = "LLMMESH_TP_TOKEN"
_LENGTH = struct.Struct("<Q")


def send_message(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> bytes | None:
    """One message, or None once the other end has closed."""
    head = _recv_exactly(sock, _LENGTH.size)
    return None if head is None else _recv_exactly(sock, _LENGTH.unpack(head)[0])


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p + 1 free too (the process group's rendezvous, then the ranks' connections)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((host, port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError(f"found no two consecutive free ports on {host}")


class BroadcastModel:
    """Rank 0's model: every call is first sent to the other ranks, which make it on their shard."""

    def __init__(self, model, executor: "MultiprocExecutor"):
        self.model, self.executor = model, executor

    def __call__(self, input_ids, positions, metadata, kv_caches, **kwargs):
        message = {"op": "forward", "args": [input_ids, positions, metadata], "kwargs": kwargs}
        return self.executor.run(message, lambda: self.model(input_ids, positions, metadata, kv_caches, **kwargs))

    def compute_logits(self, hidden_states):
        message = {"op": "logits", "hidden_states": hidden_states}
        return self.executor.run(message, lambda: self.model.compute_logits(hidden_states))

    def __getattr__(self, name):
        return getattr(self.model, name)


class MultiprocExecutor(UniProcExecutor):
    def __init__(self, args: EngineArgs, model_config: ModelConfig, model_dir: Path, max_model_len: int):
        size = args.tensor_parallel_size
        check_tensor_parallel_size(model_config, size)  # before any process starts
        self.world_size = size
        self.dead: str | None = None
        self.closing = False
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, socket.socket] = {}
        self.master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.master_port = int(os.environ.get("MASTER_PORT") or free_port_pair(self.master_addr))
        try:
            self._start_ranks(args, model_dir, max_model_len)
            device = resolve_device(args.device, 0, size)
            init_distributed(0, size, device, self.master_addr, self.master_port)
            super().__init__(args, model_config, model_dir, max_model_len)
        except BaseException:
            self.shutdown()
            raise
        self.driver_worker.model = BroadcastModel(self.driver_worker.model, self)
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()
        logger.info("Tensor parallel: %d ranks, meeting at %s:%d", size, self.master_addr, self.master_port)

    def _start_ranks(self, args: EngineArgs, model_dir: Path, max_model_len: int) -> None:
        """Start this host's ranks, wait until every rank has connected, and send each what to load."""
        local = os.environ.get(LOCAL_RANKS_ENV)
        if local is None:
            local_ranks = list(range(1, self.world_size))
        else:  # "" or "1,2": none or some of them here, the rest started by hand
            entries = [r.strip() for r in local.split(",") if r.strip()]
            if not all(r.isdigit() and 0 < int(r) < self.world_size for r in entries):
                raise ValueError(f"${LOCAL_RANKS_ENV} must list ranks of 1..{self.world_size - 1}, got {local!r}")
            local_ranks = [int(r) for r in entries]
        token = os.environ.get(TOKEN_ENV)
        if token is None and len(local_ranks) < self.world_size - 1:
            raise ValueError(f"ranks started on another host need ${TOKEN_ENV}, the same on every host")
        token = token or secrets.token_hex(16)
        listener = socket.create_server((self.master_addr, self.master_port + 1))
        listener.settimeout(1.0)
        env = {**os.environ, "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port), TOKEN_ENV: token}
        with listener:
            for rank in local_ranks:
                command = [sys.executable, "-m", "engine.executor.multiproc", "--rank", str(rank)]
                self.procs[rank] = subprocess.Popen(command, env={**env, "LOCAL_RANK": str(rank)})
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while len(self.conns) < self.world_size - 1:
                for rank, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.returncode} at start")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, self.world_size)) - set(self.conns))
                    raise RuntimeError(f"tensor-parallel ranks {missing} did not connect in {CONNECT_TIMEOUT_S:.0f} s")
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                self._admit(conn, token)
        # The other ranks load what this one loads: the same resolved model directory, no sampler, no connector.
        worker_args = dataclasses.replace(args, sampler_address=None)
        init = {"engine_args": dataclasses.asdict(worker_args), "model_dir": str(model_dir), "max_len": max_model_len}
        for conn in self.conns.values():
            send_message(conn, json.dumps(init).encode())

    def _admit(self, conn: socket.socket, token: str) -> None:
        conn.settimeout(10.0)
        try:
            hello = json.loads(recv_message(conn) or b"null")
            rank = int(hello["rank"])
            if not hmac.compare_digest(str(hello["token"]), token) or not 0 < rank < self.world_size:
                raise ValueError("a wrong token or rank")
            if rank in self.conns:
                raise ValueError(f"rank {rank} twice")
        except (OSError, ValueError, TypeError, KeyError) as e:
            logger.warning("refused a connection claiming to be a tensor-parallel rank: %s", e)
            conn.close()
            return
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conns[rank] = conn

    def _watch(self) -> None:
        """A rank's connection that closes (the rank exited, or its host went away) ends the engine."""
        conns = {conn: rank for rank, conn in self.conns.items()}
        while not self.closing and self.dead is None:
            try:
                readable, _, _ = select.select(list(conns), [], [], 0.5)
            except (OSError, ValueError):  # shutdown() closed them
                return
            for conn in readable:
                if self.closing:
                    return
                rank = conns[conn]
                try:
                    closed = conn.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    closed = True
                if closed:
                    self._fail(f"tensor-parallel rank {rank} is gone ({self._exit_status(rank)})")
                    return

    def _exit_status(self, rank: int) -> str:
        proc = self.procs.get(rank)
        if proc is None:
            return "its connection closed"
        try:
            return f"pid {proc.pid} exited with code {proc.wait(timeout=2.0)}"
        except subprocess.TimeoutExpired:
            return f"pid {proc.pid} closed its connection"

    def _fail(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            logger.error("%s: the engine cannot go on", reason)
            if self.on_failure is not None:
                self.on_failure(reason)

    def run(self, message: dict, call):
        """Send a model call to the other ranks, then make it here; a failure of either ends the engine."""
        if self.dead is not None:
            raise ExecutorDeadError(self.dead)
        try:
            data = encode(message)
            for conn in self.conns.values():
                send_message(conn, data)
            return call()
        except Exception as e:
            # A collective fails as soon as a peer's connection drops; give the watcher a moment to name the rank.
            deadline = time.monotonic() + 3.0
            while self.dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self._fail(f"a tensor-parallel step failed ({type(e).__name__}: {e})")
            raise ExecutorDeadError(self.dead) from e

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Every rank's KV cache has the same number of blocks (rank 0's sizing), each of its own heads."""
        data = encode({"op": "initialize_kv_cache", "num_blocks": num_blocks})
        for conn in self.conns.values():
            send_message(conn, data)
        super().initialize_kv_cache(num_blocks)

    def shutdown(self) -> None:
        self.closing = True
        for conn in self.conns.values():
            try:
                send_message(conn, encode({"op": "shutdown"}))
            except OSError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns.values():
            conn.close()
        if hasattr(self, "driver_worker"):
            self.driver_worker.shutdown()
        destroy_distributed()


# ---- ranks 1..N-1 ------------------------------------------------------------------


def run_worker(rank: int) -> None:
    """Connect to rank 0, load this rank's shard, and make each call rank 0 sends until it says to stop."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    sock = _connect((addr, port + 1))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_message(sock, json.dumps({"rank": rank, "token": os.environ.get(TOKEN_ENV, "")}).encode())
    init = json.loads(recv_message(sock) or b"null")
    if init is None:
        raise SystemExit(f"rank {rank}: rank 0 closed the connection at start")
    args = EngineArgs(**init["engine_args"])
    model_dir = Path(init["model_dir"])
    device = resolve_device(args.device, rank, args.tensor_parallel_size)
    init_distributed(rank, args.tensor_parallel_size, device, addr, port)
    worker = Worker(args, load_config(model_dir), model_dir, init["max_len"])
    worker.load_model()
    with torch.inference_mode():
        while (data := recv_message(sock)) is not None:
            message = decode(data, worker.device)
            op = message["op"]
            if op == "forward":
                input_ids, positions, metadata = message["args"]
                caches = worker.kv_caches or _scratch_kv_caches(worker, metadata)
                worker.model(input_ids, positions, metadata, caches, **message["kwargs"])
            elif op == "logits":
                worker.model.compute_logits(message["hidden_states"])
            elif op == "initialize_kv_cache":
                worker.initialize_kv_cache(message["num_blocks"])
            elif op == "shutdown":
                break
            else:
                raise ValueError(f"rank {rank}: unknown call {op!r} from rank 0")
    worker.shutdown()


def _connect(address: tuple[str, int]) -> socket.socket:
    """A connection to rank 0, which a rank started by hand may have to wait for."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection(address, timeout=10.0)
            sock.settimeout(None)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _scratch_kv_caches(worker: Worker, metadata) -> list:
    """Caches for a forward pass before the KV cache exists (rank 0 profiling memory on a GPU)."""
    cfg, bs = worker.model_config, worker.args.block_size
    num_blocks = int(metadata.block_table.max()) + 1
    shape = worker.attn_backend.get_kv_cache_shape(num_blocks, bs, worker.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=worker.dtype, device=worker.device),) * 2 for _ in range(cfg.num_hidden_layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description="One tensor-parallel rank of an llmmesh engine (not rank 0).")
    parser.add_argument("--rank", type=int, required=True, help="this process's rank, 1..N-1")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {parser.parse_known_args()[0].rank} %(message)s")
    run_worker(parser.parse_args().rank)


if __name__ == "__main__":
    main()
