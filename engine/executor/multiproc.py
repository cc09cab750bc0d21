"""The multiprocess executor: one worker per rank, tensor- and pipeline-parallel (vLLM's MultiprocExecutor).

Rank 0's worker runs in the engine core's process and does everything a lone worker does (sizing the KV cache
with the others, sampling); ranks 1..N-1 are processes of their own (`python -m engine.executor.multiproc
--rank R`), started here or by hand on another host. The scheduler runs once, in the engine core: every rank
gets each step's SchedulerOutput and runs its own Worker and ModelRunner on it, over its own input buffers,
block tables and request states, so the ranks meet in the same collectives in the same order. Rank 0 alone
samples and returns the ModelRunnerOutput. collective_rpc runs a Worker method on every rank (adapters, the KV
cache's sizing) and returns each rank's result.

With pipeline parallelism (P stages of TP ranks, rank = stage * TP + tp_rank: engine.distributed.parallel_state)
rank 0 is the first stage's first rank, and it is the last stage's first rank, rank (P - 1) * TP, that samples and
sends the ModelRunnerOutput back to rank 0 over its connection. execute_model(non_block=True) returns once rank 0
has run its stage, with a PipelineOutput to take the step's output from later: the engine core schedules the next
batch meanwhile (EngineCore.step_with_batch_queue), and the stages work on different batches at once.

Messages cross a TCP connection from each rank to rank 0 (at MASTER_PORT + 1) as engine.executor.messages
encodes them, never pickled. A connection that closes is a rank gone: the engine ends with an error naming it
(ExecutorDeadError), and a step blocked in a collective with a rank that stopped fails after the group's
timeout instead of hanging. A rank whose connection to rank 0 closes exits.
"""

import argparse
import dataclasses
import hmac
import json
import logging
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch

from engine.config import EngineArgs, EngineConfig
from engine.distributed.parallel_state import destroy_distributed, init_distributed, set_cpu_threads
from engine.executor.messages import decode, encode, scheduler_output_from_wire, scheduler_output_to_wire
from engine.executor.uniproc import ExecutorDeadError, UniProcExecutor
from engine.framing import recv_frame, send_frame
from engine.kv.connector.base import KVConnectorOutput
from engine.models.config import ModelArchConfig
from engine.models.files import load_config
from engine.models.linear import check_tensor_parallel_size
from engine.models.utils import get_pp_indices
from engine.request import Request
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import Worker, resolve_device

logger = logging.getLogger("llmmesh.engine")

# Seconds rank 0 waits for every other rank to connect: ranks started by hand elsewhere may take a while.
CONNECT_TIMEOUT_S = 300.0
# Ranks of this host that the executor starts itself (comma-separated); unset: all of 1..N-1. The others are
# started by hand (see docs/deployment.md) with the same $LLMMESH_TP_TOKEN.
LOCAL_RANKS_ENV = "LLMMESH_TP_LOCAL_RANKS"
TOKEN_ENV = "LLMMESH_TP_TOKEN"
# torchrun's name: how many ranks share this host's cores (the executor sets it for the ranks it starts).
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
_HELLO_BYTES = 4096  # a rank's first message, read before its token is checked


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


class KVOutputAggregator:
    """The ranks' KV connector reports as one (vLLM's KVOutputAggregator). Each rank moves its own heads of every
    block, so a transfer has finished once every rank has reported it; a load brought the blocks every rank
    brought (a rank that missed its shard of a block makes the scheduler recompute from there on all ranks), and a
    store reached the store only if every rank's did. The worker side's counters are rank 0's."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.recving: dict[str, list[int]] = {}  # request id -> tokens each rank that reported has loaded
        self.sending: dict[int, list[bool]] = {}  # store job id -> whether each rank that reported stored

    def aggregate(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        done = KVConnectorOutput(load_timings=outputs[0].load_timings, kv_connector_stats=outputs[0].kv_connector_stats)
        for output in outputs:
            for request_id, num_tokens in output.finished_recving.items():
                if self._report(self.recving, request_id, num_tokens):
                    done.finished_recving[request_id] = min(self.recving.pop(request_id))
            for job_id, stored in output.finished_sending.items():
                if self._report(self.sending, job_id, stored):
                    done.finished_sending[job_id] = all(self.sending.pop(job_id))
        return done

    def _report(self, reports: dict, key, value) -> bool:
        """Count one rank's report; whether every rank has now reported key."""
        reports.setdefault(key, []).append(value)
        return len(reports[key]) == self.world_size


class PipelineOutput:
    """A step's ModelRunnerOutput, which the last pipeline stage sends when it has sampled (vLLM's Future)."""

    def __init__(self, take=None, output: ModelRunnerOutput | None = None):
        self.take, self.output = take, output

    def result(self) -> ModelRunnerOutput:
        if self.output is None:
            self.output = self.take()
        return self.output


class MultiprocExecutor(UniProcExecutor):
    def __init__(self, config: EngineConfig, model_config: ModelArchConfig, model_dir: Path, max_model_len: int):
        parallel = config.parallel_config
        tp, size = parallel.tensor_parallel_size, parallel.world_size
        check_tensor_parallel_size(model_config, tp, parallel.enable_expert_parallel)  # before any process starts
        get_pp_indices(model_config.num_hidden_layers, 0, parallel.pipeline_parallel_size)
        self.world_size = size
        # The rank that samples: the last pipeline stage's first (rank 0 without pipeline parallelism).
        self.output_rank = size - tp
        self.dead: str | None = None
        self.closing = False
        self.on_failure = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, socket.socket] = {}
        self.replies: dict[int, queue.SimpleQueue] = {}
        # Request id -> how many of its tokens the other ranks hold (each step sends them only the rest).
        self.sent_tokens: dict[str, int] = {}
        self.threads_before = torch.get_num_threads()
        self.kv_outputs = KVOutputAggregator(size)
        self.master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.master_port = int(os.environ.get("MASTER_PORT") or free_port_pair(self.master_addr))
        try:
            local_ranks = self._start_ranks(config, model_dir, max_model_len)
            for rank, conn in self.conns.items():
                self.replies[rank] = queue.SimpleQueue()
                threading.Thread(target=self._read, args=(rank, conn), name=f"tp-rank-{rank}", daemon=True).start()
            device = resolve_device(config.model_config.device, 0, size)
            if device.type == "cpu":
                set_cpu_threads(1 + len(local_ranks))
            invariant = config.model_config.batch_invariant == "on"
            init_distributed(
                0, size, device, self.master_addr, self.master_port, parallel.enable_expert_parallel, tp, invariant
            )
            super().__init__(config, model_config, model_dir, max_model_len)
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "Tensor parallel: %d ranks x %d pipeline stages, meeting at %s:%d",
            tp, parallel.pipeline_parallel_size, self.master_addr, self.master_port,
        )  # fmt: skip

    def _start_ranks(self, config: EngineConfig, model_dir: Path, max_model_len: int) -> list[int]:
        """Start this host's ranks, wait until every rank has connected, and send each what to load; the ranks
        started here."""
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
        env[LOCAL_WORLD_SIZE_ENV] = str(1 + len(local_ranks))
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
        # The other ranks load what this one loads: the same resolved model directory; they sample nowhere. The
        # settings go as the flat EngineArgs, JSON, and each rank composes its EngineConfig from them.
        worker_args = dataclasses.replace(EngineArgs.from_engine_config(config), sampler_address=None)
        init = {"engine_args": dataclasses.asdict(worker_args), "model_dir": str(model_dir), "max_len": max_model_len}
        for conn in self.conns.values():
            send_frame(conn, json.dumps(init).encode())
        return local_ranks

    def _admit(self, conn: socket.socket, token: str) -> None:
        conn.settimeout(10.0)
        try:
            hello = json.loads(recv_frame(conn, _HELLO_BYTES) or b"null")
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

    def _read(self, rank: int, conn: socket.socket) -> None:
        """Rank `rank`'s replies, into its queue. A connection that closes (the rank exited, or its host went away)
        ends the engine."""
        while True:
            try:
                data = recv_frame(conn)
                reply = None if data is None else decode(data, torch.device("cpu"))
            except (OSError, ValueError):
                reply = None
            if reply is None:
                if not self.closing:
                    self._fail(f"tensor-parallel rank {rank} is gone ({self._exit_status(rank)})")
                return
            self.replies[rank].put(reply)

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

    def _send(self, message: dict) -> None:
        data = encode(message)
        for conn in self.conns.values():
            send_frame(conn, data)

    def execute_model(
        self, scheduler_output: SchedulerOutput, *args, non_block: bool = False
    ) -> ModelRunnerOutput | PipelineOutput:
        """Every rank runs the step; the sampling rank's output (args: as UniProcExecutor's). non_block: return
        once this rank's stage has run, with a PipelineOutput to take it from. A failure of any rank ends the
        engine."""
        if self.dead is not None:
            raise ExecutorDeadError(self.dead)
        try:
            self._send(
                {
                    "op": "execute_model",
                    "scheduler_output": scheduler_output_to_wire(
                        scheduler_output, self.sent_tokens, with_sampling=self.output_rank > 0
                    ),
                }
            )
            output = super().execute_model(scheduler_output, *args)
            if self.output_rank and not scheduler_output.is_empty:  # the last stage sends it when it has sampled
                future = PipelineOutput(partial(self._take_output, self.output_rank))
                return future if non_block else future.result()
            if output.kv_connector_output is not None:  # each other rank reports its own transfers
                reports = [self._reply(rank)["kv_connector_output"] for rank in sorted(self.conns)]
                output.kv_connector_output = self.kv_outputs.aggregate([output.kv_connector_output, *reports])
        except Exception as e:
            raise self._step_failed(e) from e
        return PipelineOutput(output=output) if non_block else output

    def _take_output(self, rank: int) -> ModelRunnerOutput:
        try:
            return self._reply(rank)["runner_output"]
        except Exception as e:
            raise self._step_failed(e) from e

    def _step_failed(self, e: Exception) -> ExecutorDeadError:
        """The error to end the engine with (every rank's step is lost)."""
        # A collective fails as soon as a peer's connection drops; give the reader a moment to name the rank.
        deadline = time.monotonic() + 3.0
        while self.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self._fail(f"a parallel step failed ({type(e).__name__}: {e})")
        return ExecutorDeadError(self.dead)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """Worker.<method>(*args, **kwargs) on every rank at once (rank 0 here); the results in rank order.

        Every rank answers before an error is raised, so the ranks stay in step: a ValueError on any rank is
        raised as a ValueError naming the rank (a bad adapter, say), anything else as a RuntimeError."""
        if self.dead is not None:
            raise ExecutorDeadError(self.dead)
        kwargs = kwargs or {}
        self._send({"op": "rpc", "method": method, "args": list(args), "kwargs": kwargs})
        results, errors = [None] * self.world_size, []
        try:
            results[0] = getattr(self.driver_worker, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (raised once every rank has answered)
            errors.append(e)
        for rank in sorted(self.conns):
            reply = self._reply(rank)
            if "error" in reply:
                kind = ValueError if reply["type"] == "ValueError" else RuntimeError
                errors.append(kind(f"tensor-parallel rank {rank}: {reply['error']}"))
            else:
                results[rank] = reply["result"]
        if errors:
            raise errors[0]
        return results

    def _reply(self, rank: int) -> dict:
        while True:
            try:
                return self.replies[rank].get(timeout=0.5)
            except queue.Empty:
                if self.dead is not None:
                    raise ExecutorDeadError(self.dead) from None

    def determine_num_available_blocks(self) -> int:
        """The fewest blocks any rank has room for: every rank's KV cache has that many, each of its own heads."""
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def shutdown(self) -> None:
        self.closing = True
        for conn in self.conns.values():
            try:
                send_frame(conn, encode({"op": "shutdown"}))
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
        torch.set_num_threads(self.threads_before)


# ---- ranks 1..N-1 ------------------------------------------------------------------


def run_worker(rank: int) -> None:
    """Connect to rank 0, load this rank's shard, and run what rank 0 sends (steps, calls) until it says to stop."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    sock = _connect((addr, port + 1))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_frame(sock, json.dumps({"rank": rank, "token": os.environ.get(TOKEN_ENV, "")}).encode())
    init = json.loads(recv_frame(sock) or b"null")
    if init is None:
        raise SystemExit(f"rank {rank}: rank 0 closed the connection at start")
    config = EngineArgs(**init["engine_args"]).create_engine_config()
    model_dir = Path(init["model_dir"])
    parallel = config.parallel_config
    tp, size = parallel.tensor_parallel_size, parallel.world_size
    device = resolve_device(config.model_config.device, rank, size)
    if device.type == "cpu":
        set_cpu_threads(int(os.environ.get(LOCAL_WORLD_SIZE_ENV) or 1))
    invariant = config.model_config.batch_invariant == "on"
    init_distributed(rank, size, device, addr, port, parallel.enable_expert_parallel, tp, invariant)
    # The last pipeline stage's first rank samples, and sends rank 0 each step's output.
    sends_output = parallel.pipeline_parallel_size > 1 and rank == size - tp
    worker = Worker(config, load_config(model_dir), model_dir, init["max_len"])
    worker.load_model()
    states: dict[str, Request] = {}  # this rank's request states, kept up to date by each step's SchedulerOutput
    while (data := recv_frame(sock)) is not None:
        message = decode(data, torch.device("cpu"))
        op = message["op"]
        if op == "execute_model":
            scheduler_output = scheduler_output_from_wire(message["scheduler_output"], states)
            output = worker.execute_model(scheduler_output)
            if sends_output and not scheduler_output.is_empty:
                send_frame(sock, encode({"runner_output": output}))
            elif output.kv_connector_output is not None:
                send_frame(sock, encode({"kv_connector_output": output.kv_connector_output}))
        elif op == "rpc":
            send_frame(sock, encode(_call(worker, message)))
        elif op == "shutdown":
            break
        else:
            raise ValueError(f"rank {rank}: unknown message {op!r} from rank 0")
    worker.shutdown()


def _call(worker: Worker, message: dict) -> dict:
    try:
        return {"result": getattr(worker, message["method"])(*message["args"], **message["kwargs"])}
    except Exception as e:  # noqa: BLE001 (rank 0 raises it)
        return {"error": str(e), "type": type(e).__name__}


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


def main() -> None:
    parser = argparse.ArgumentParser(description="One tensor-parallel rank of an llmmesh engine (not rank 0).")
    parser.add_argument("--rank", type=int, required=True, help="this process's rank, 1..N-1")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {parser.parse_known_args()[0].rank} %(message)s")
    run_worker(parser.parse_args().rank)


if __name__ == "__main__":
    main()
