"""llmmesh.v1.KVStore: KV-cache blocks in Redis, a thin adapter over redis-py's asyncio client.

A block lives under `kv:{fingerprint}:{block hash in hex}` as a small header (magic, version, dtype, shape,
layer count, block size, data length, CRC-32C of the data) followed by the raw bytes (services/kvstore_layout.py);
nothing is pickled. A value whose header does not match the layout asked for, or whose checksum fails, is
deleted, counted and treated as missing. Redis is a cache (allkeys-lru): any block may vanish at any time.

Every RPC takes a few round trips whatever its number of blocks: Lookup one pipelined EXISTS, Put one
pipelined EXISTS and one pipelined SET per message, Delete one DEL. Get pipelines one MGET a chunk of at most
GET_CHUNK_BYTES on a connection of its own (the next chunk's MGET goes out before this one's reply is read), and
receives each block's data in place (services/block_reader.py): into the caller's shared memory when
the Get names a segment the kvstore can map (an engine on this host), otherwise into a buffer that the
GetResponse carries. Health is NOT_SERVING while Redis does not answer PING, and every RPC then answers
UNAVAILABLE within --redis-timeout.

A rediss:// URL speaks TLS to Redis, checking its certificate against the system's CAs and --redis-ca-file's, and
presents --redis-cert-file when Redis asks for a client certificate. Plaintext redis:// reaches loopback only, unless
--redis-allow-plaintext says the network between them is private.
"""

import argparse
import asyncio
import contextlib
import functools
import inspect
import logging
import mmap
import ssl
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import grpc
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from engine.config.utils import add_cli_args
from engine.malloc import keep_freed_memory_in_process
from llmmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from mesh.kvstore.wire import SEGMENT_PREFIX
from mesh.shared_memory import is_segment_name, open_segment
from mesh.tls import is_loopback
from services import config
from services.block_reader import BlockReader
from services.kvstore_layout import TAG_BYTES, Layout, block_key, check_fingerprint
from services.server import MAX_MESSAGE_BYTES, Server
from services.settings import KVStoreConfig, KVStoreFlags

logger = logging.getLogger("llmmesh.kvstore")

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name

HASH_BYTES = 32
GET_CHUNK_BYTES = 4 * 2**20  # one MGET, and one GetResponse, holds at most this much (or one block)
HEALTH_INTERVAL = 0.5  # s between PINGs
COUNTERS = ("hits", "misses", "corrupt_blocks", "redis_errors", "blocks_stored", "bytes_in", "bytes_out")
REDIS_ERRORS = (RedisError, OSError)
MAX_SEGMENTS = 16  # engines' segments kept mapped (the oldest is let go: its engine then offers a new one)
SEGMENT_IDLE_S = 300.0  # a segment no Get used for this long is let go (its engine may be gone: its memory with it)


class Segments:
    """Engines' shared-memory segments that Gets write into, mapped once each and kept while they are used (at most
    MAX_SEGMENTS, none idle for SEGMENT_IDLE_S). The engine unlinks a segment's name once a Get has used it, so a
    mapping let go cannot be had again: the engine's next Get gets bytes, and the one after offers a new segment."""

    def __init__(self):
        self.maps: OrderedDict[str, tuple[mmap.mmap, float]] = OrderedDict()  # name -> (mapping, last used)

    def view(self, name: str, nbytes: int) -> memoryview | None:
        """The segment's memory, or None where it cannot be mapped here (another host, or a name gone)."""
        if not is_segment_name(name, SEGMENT_PREFIX):
            raise ValueError(f"shared_memory must be llmmesh-kv- and 32 lowercase hex digits; got {name[:80]!r}")
        now = time.monotonic()
        segment, _ = self.maps.pop(name, (None, now))
        while self.maps and now - next(iter(self.maps.values()))[1] > SEGMENT_IDLE_S:
            self.maps.popitem(last=False)  # unmapped once no Get still writes it
        if segment is None:
            try:
                segment = open_segment(name)
            except (OSError, ValueError) as e:
                logger.info("an engine's shared memory cannot be used here (%s): its Gets carry the blocks", e)
                return None
        self.maps[name] = (segment, now)
        while len(self.maps) > MAX_SEGMENTS:
            self.maps.popitem(last=False)
        if len(segment) < nbytes:
            raise ValueError(
                f"shared_memory: the segment holds {len(segment)} bytes and the blocks asked for need {nbytes}"
            )
        return memoryview(segment)


def get_response_bytes(blocks: memoryview, tags: bytes) -> bytes:
    """A GetResponse's wire bytes: field 2 (`data`, length-delimited) with the blocks back to back, in one copy,
    then field 4 (`tags`). Building a GetResponse would copy the blocks twice more (into the message, then out of
    it), a large share of a reload's time."""
    return b"".join((_field_header(b"\x12", len(blocks)), blocks, _field_header(b"\x22", len(tags)), tags))


def _field_header(key: bytes, length: int) -> bytes:
    """A length-delimited field's key, then its length as a varint: 7 bits a byte, low bits first."""
    header = bytearray(key)
    while length > 0x7F:
        header.append(length & 0x7F | 0x80)
        length >>= 7
    header.append(length)
    return bytes(header)


def add_to_server(service: "KVStoreService", server) -> None:
    """kvstore_pb2_grpc's registration, but Get's responses leave as the bytes get_response_bytes builds."""
    pb = kvstore_pb2
    handlers = {
        "Lookup": grpc.unary_unary_rpc_method_handler(
            service.Lookup, pb.LookupRequest.FromString, pb.LookupResponse.SerializeToString
        ),
        "Put": grpc.stream_unary_rpc_method_handler(
            service.Put, pb.PutRequest.FromString, pb.PutResponse.SerializeToString
        ),
        "Get": grpc.unary_stream_rpc_method_handler(service.Get, pb.GetRequest.FromString),
        "Delete": grpc.unary_unary_rpc_method_handler(
            service.Delete, pb.DeleteRequest.FromString, pb.DeleteResponse.SerializeToString
        ),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats, pb.StatsRequest.FromString, pb.StatsResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


@dataclass(frozen=True)
class RedisTLS:
    """rediss://'s files: the CA that signed Redis's certificate, and a client certificate for a Redis that asks."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def redis_options(self) -> dict:
        """redis-py's options for the same: its context trusts the system's CAs and ca_file's, as context() does."""
        return dict(ssl_ca_certs=self.ca_file, ssl_certfile=self.cert_file, ssl_keyfile=self.key_file)

    def context(self) -> ssl.SSLContext:
        """The context of a Get's own connection (services/block_reader.py); ValueError naming a file it cannot use."""
        context = ssl.create_default_context()
        try:
            if self.ca_file:
                context.load_verify_locations(self.ca_file)
            if self.cert_file:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--redis-ca-file, --redis-cert-file, --redis-key-file: {e}") from None
        return context


def redis_where(url: str) -> str:
    """host:port/db of a redis:// URL, without its credentials."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"


def _leading(flags) -> int:
    """The length of the leading run of true flags."""
    run = 0
    for flag in flags:
        if not flag:
            break
        run += 1
    return run


def _statuses(handler):
    """A handler whose ValueError answers INVALID_ARGUMENT and whose Redis error answers UNAVAILABLE."""
    if inspect.isasyncgenfunction(handler):

        async def stream(self, request, context):
            try:
                async with contextlib.aclosing(handler(self, request, context)) as responses:
                    async for response in responses:
                        yield response
            except (ValueError, *REDIS_ERRORS) as e:
                await self.abort(context, e)

        return functools.wraps(handler)(stream)

    async def unary(self, request, context):
        try:
            return await handler(self, request, context)
        except (ValueError, *REDIS_ERRORS) as e:
            await self.abort(context, e)

    return functools.wraps(handler)(unary)


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(
        self,
        redis_url: str,
        redis_timeout: float = 2.0,
        max_blocks_per_request: int = 65536,
        max_block_bytes: int = MAX_MESSAGE_BYTES - 2**20,
        tls: RedisTLS | None = None,
    ):
        # One retry, at once and only on a broken connection: a pooled connection that a Redis restart broke
        # reconnects, while a Redis that is down or stuck answers UNAVAILABLE within the timeout.
        options = dict(socket_timeout=redis_timeout, socket_connect_timeout=redis_timeout)
        self.ssl_context = None
        if redis_url.startswith("rediss://"):
            tls = tls or RedisTLS()
            self.ssl_context = tls.context()  # checks the files before the first call needs them
            options.update(tls.redis_options())
        retry = dict(backoff=NoBackoff(), retries=1, supported_errors=(RedisConnectionError,))
        self.redis = aioredis.from_url(redis_url, retry=AsyncRetry(**retry), **options)
        self.redis_url, self.redis_timeout = redis_url, redis_timeout
        self.segments = Segments()
        self.where = redis_where(redis_url)
        self.max_blocks = max_blocks_per_request
        self.max_block_bytes = max_block_bytes
        self.counters = dict.fromkeys(COUNTERS, 0)

    async def abort(self, context, error: Exception) -> None:
        if isinstance(error, ValueError) and not isinstance(error, OSError):  # a certificate refused is both
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self.counters["redis_errors"] += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"redis at {self.where} is unreachable: {error}")

    async def redis_answers(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except REDIS_ERRORS:
            return False

    def count(self, **amounts: int) -> None:
        for name, amount in amounts.items():
            self.counters[name] += amount

    def check_hashes(self, hashes, field: str = "block_hashes", item: str = "") -> list[bytes]:
        if len(hashes) > self.max_blocks:
            raise ValueError(
                f"{field} holds {len(hashes)} blocks; at most {self.max_blocks} are allowed in one "
                "request (--max-blocks-per-request)"
            )
        for i, block_hash in enumerate(hashes):
            if len(block_hash) != HASH_BYTES:
                raise ValueError(
                    f"{field}[{i}]{item} must be {HASH_BYTES} bytes (a sha256 block hash); got {len(block_hash)}"
                )
        return list(hashes)

    def layout(self, request) -> Layout:
        if not request.HasField("layout"):
            raise ValueError(
                "layout must be set (in a Put, in the stream's first message): the blocks' fingerprint, "
                "dtype, shape, num_layers and block_size"
            )
        return Layout(request.layout, self.max_block_bytes)

    async def exists(self, keys: list[str]) -> list[bool]:
        """One pipelined EXISTS for all the keys."""
        if not keys:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in await pipe.execute()]

    @staticmethod
    def read_chunk(reader: BlockReader, layout: Layout, into: memoryview, then: list[str]) -> tuple[int, str, bytes]:
        """Receive the next len(into) // layout.nbytes blocks into `into` (on a thread), once the MGET of the keys
        `then` is sent: how many came intact, what the first of the others was ("missing" or "damaged"), and the
        intact ones' tags."""
        if then:
            reader.send(then)  # Redis works on the next chunk while this one is received
        n, tags = layout.nbytes, []

        def check(prefix: bytes, data: memoryview) -> bool:
            tags.append(layout.tag(prefix))
            return layout.check(prefix, data)

        reader.read_values(len(into) // n)
        for i in range(len(into) // n):
            status = reader.read_value(layout.prefix_bytes, into[i * n : (i + 1) * n], check)
            if status != "ok":
                return i, status, b"".join(tags[:i])
        return len(into) // n, "ok", b"".join(tags)

    def keys(self, request) -> list[str]:
        """The keys of a Lookup's or Delete's blocks, checked."""
        fingerprint = check_fingerprint(request.fingerprint, "fingerprint")
        return [block_key(fingerprint, h) for h in self.check_hashes(request.block_hashes)]

    @_statuses
    async def Lookup(self, request, context):
        keys = self.keys(request)
        flags = await self.exists(keys)
        present = _leading(flags)
        self.count(hits=present, misses=len(keys) - present)
        return kvstore_pb2.LookupResponse(num_present=present, present=flags)

    @_statuses
    async def Put(self, request_iterator, context):
        layout = first = None
        stored = skipped = 0
        async for request in request_iterator:
            if first is None:
                layout, first = self.layout(request), request.layout
            elif request.HasField("layout") and request.layout != first:
                raise ValueError(
                    "layout: a later message's layout must equal the first one's (one Put stream "
                    "stores blocks of one layout); leave it unset after the first message"
                )
            self.check_hashes([b.block_hash for b in request.blocks], "blocks", ".block_hash")
            blocks = {}
            for i, block in enumerate(request.blocks):
                if len(block.data) != layout.nbytes:
                    raise ValueError(
                        f"blocks[{i}].data must be {layout.nbytes} bytes (the layout's size); got {len(block.data)}"
                    )
                if len(block.tag) not in (0, TAG_BYTES):
                    raise ValueError(f"blocks[{i}].tag must be {TAG_BYTES} bytes or empty; got {len(block.tag)}")
                blocks[layout.key(block.block_hash)] = (block.data, block.tag or bytes(TAG_BYTES))
            missing = [key for key, present in zip(blocks, await self.exists(list(blocks))) if not present]
            written = 0
            if missing:
                pipe = self.redis.pipeline(transaction=False)
                for key in missing:
                    pipe.set(key, layout.encode(*blocks[key]), nx=True)  # nx: one Put racing another stores once
                written = sum(1 for ok in await pipe.execute() if ok)
            stored += written
            skipped += len(request.blocks) - written
            self.count(blocks_stored=written, bytes_in=len(request.blocks) * layout.nbytes)
        return kvstore_pb2.PutResponse(num_stored=stored, num_skipped=skipped)

    @_statuses
    async def Get(self, request, context):
        layout = self.layout(request)
        hashes = self.check_hashes(request.block_hashes)
        shared = None
        if request.shared_memory:
            shared = self.segments.view(request.shared_memory, len(hashes) * layout.nbytes)
        per_chunk = max(1, GET_CHUNK_BYTES // (layout.prefix_bytes + layout.nbytes))
        chunks = [[layout.key(h) for h in hashes[i : i + per_chunk]] for i in range(0, len(hashes), per_chunk)]
        served, reader = 0, None
        try:
            if chunks:
                reader = await asyncio.to_thread(BlockReader, self.redis_url, self.redis_timeout, self.ssl_context)
                reader.send(chunks[0])
            for i, keys in enumerate(chunks):
                size = len(keys) * layout.nbytes
                into = shared[served * layout.nbytes :][:size] if shared is not None else memoryview(bytearray(size))
                then = chunks[i + 1] if i + 1 < len(chunks) else []
                found, status, tags = await asyncio.to_thread(self.read_chunk, reader, layout, into, then)
                if status == "damaged":
                    logger.warning("dropping %s: its header or checksum does not match", keys[found])
                    self.count(corrupt_blocks=1)
                    await self.redis.delete(keys[found])
                served += found
                self.count(bytes_out=found * layout.nbytes)
                if found:
                    yield (
                        kvstore_pb2.GetResponse(num_blocks=found, tags=tags).SerializeToString()
                        if shared is not None
                        else get_response_bytes(into[: found * layout.nbytes], tags)
                    )
                if found < len(keys):
                    break
        finally:
            if reader is not None:
                reader.close()  # also ends a read still under way on its thread (an RPC cancelled)
            self.count(hits=served, misses=len(hashes) - served)

    @_statuses
    async def Delete(self, request, context):
        keys = self.keys(request)
        return kvstore_pb2.DeleteResponse(num_deleted=await self.redis.delete(*keys) if keys else 0)

    @_statuses
    async def Stats(self, request, context):
        pipe = self.redis.pipeline(transaction=False)
        pipe.dbsize()
        pipe.info("memory")
        keys, memory = await pipe.execute()
        return kvstore_pb2.StatsResponse(keys=keys, bytes=memory["used_memory"], **self.counters)


# ---- the process -------------------------------------------------------------------------------


async def serve(args) -> None:
    keep_freed_memory_in_process()  # a Get copies its blocks into new buffers of megabytes
    url = redis_url_with_password(args.redis_url, args.redis_password_file)
    tls = RedisTLS(args.redis_ca_file, args.redis_cert_file, args.redis_key_file)
    service = KVStoreService(url, args.redis_timeout, args.max_blocks_per_request, args.max_block_bytes, tls)
    server = Server("kvstore", [SERVICE_NAME], args)
    server.add(add_to_server, service)
    server.telemetry.count("llmmesh:kvstore_", service.counters)  # hits, misses, bytes, corrupt blocks...
    await server.start()
    server.follow(service.redis_answers, f"redis at {service.where}", HEALTH_INTERVAL)
    try:
        await server.serve_until_stopped()
    finally:
        await service.redis.aclose()


def redis_url_with_password(url: str, password_file: str | None) -> str:
    """The Redis URL with the password of password_file in it: the password travels in a file, never on a command
    line (readable by anyone in /proc), and the URL with it stays in this process."""
    if password_file is None:
        return url
    try:
        with open(password_file) as f:
            password = f.read().strip()
    except OSError as e:
        raise ValueError(f"--redis-password-file {password_file}: {e.strerror}") from None
    scheme, rest = url.split("://", 1)
    user, at, where = rest.rpartition("@")
    if ":" in user:
        raise ValueError("--redis-url holds a password: give it in --redis-password-file instead")
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{where}"


def add_store_args(parser: argparse.ArgumentParser) -> None:
    """The kvstore's flags besides its Redis's address (`llmmesh serve` passes them on to its kvstore)."""
    add_cli_args(parser, KVStoreConfig)


def add_subcommands(subparsers) -> None:
    parser = config.service_parser(subparsers, "kvstore", "serve llmmesh.v1.KVStore (KV-cache blocks in Redis)")
    add_cli_args(parser, KVStoreFlags, grouped=False)
    add_store_args(parser)

    def run(args):
        for flag in ("redis_timeout", "max_blocks_per_request", "max_block_bytes"):
            if getattr(args, flag) <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}.")
        check_redis_link(args)
        config.run(serve(args), args)

    parser.set_defaults(func=run)


def check_redis_link(args) -> None:
    """--redis-url and its TLS flags agree; plaintext leaves the host only with --redis-allow-plaintext, since anyone
    on the path would read every block and the Redis password."""
    url = args.redis_url
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"--redis-url must look like redis://HOST:PORT/DB or rediss://HOST:PORT/DB, got {url!r}.")
    if bool(args.redis_cert_file) != bool(args.redis_key_file):
        raise ValueError("--redis-cert-file and --redis-key-file go together: give both or neither.")
    if url.startswith("redis://"):
        given = [f for f in ("redis_ca_file", "redis_cert_file", "redis_key_file") if getattr(args, f)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is for TLS: give a rediss:// --redis-url.")
        host = urlsplit(url).hostname or "localhost"
        if not is_loopback(host) and not args.redis_allow_plaintext:
            raise ValueError(
                f"--redis-url {redis_where(url)} is plaintext to a host other than loopback: use rediss:// (Redis "
                "with TLS), or give --redis-allow-plaintext where the network between them is private."
            )
