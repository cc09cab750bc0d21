"""The one gRPC policy of the mesh: message size and keepalive, for every server and every channel.

It lives one floor below the services because the engine's plug-ins (the kvstore connector, the remote sampler) are gRPC
clients too (layers point one way: services -> mesh -> engine).
"""

from engine.framing import MAX_MESSAGE_BYTES

# One keepalive policy for every link: clients ping an idle connection every KEEPALIVE_TIME_MS, and
# servers accept pings that often (a server that accepts fewer answers GOAWAY too_many_pings and breaks
# every stream on the connection).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = _KEEPALIVE + [
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
CHANNEL_OPTIONS = _KEEPALIVE + [
    # gRPC's 4 MiB default lifted to the mesh's one limit: internal messages carry whole-vocabulary logprobs.
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # gRPC's reconnect backoff grows to two minutes; a dependency restarted at the same address must be
    # found again within a second or so. (grpc.min_reconnect_backoff_ms stays at its default: gRPC takes it for
    # the least time a connection attempt gets, and a TLS handshake with a busy peer can take more than 100 ms.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
