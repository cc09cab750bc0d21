"""The client of the public API: `generate()`, `chat()` and `collect()` for programs, tests and benchmarks,
and the `llmmesh generate` / `llmmesh chat` commands that stream from a running gateway to the terminal."""

import argparse
import functools
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from engine.config.utils import add_cli_args
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from mesh import tls
from services.settings import DEFAULT_ADDRESS, ChatFlags, ClientConfig, GenerateFlags  # noqa: F401 (the default address)
from services.tenants import refuse_key_on_command_line

# ---- the client ----------------------------------------------------------------------------------


def gateway_credentials(tls_ca: str | None = None, insecure_plaintext: bool | None = None):
    """TLS credentials for a gateway, its certificate checked against tls_ca (default: the mesh's ca.crt in
    LLMMESH_TLS_DIR or the state directory); None (plaintext) only when asked (default: LLMMESH_INSECURE_PLAINTEXT)."""
    if insecure_plaintext if insecure_plaintext is not None else tls.plaintext_from_env():
        return None
    path = tls_ca or os.path.join(tls.default_tls_dir(), "ca.crt")
    try:
        with open(path, "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    except OSError as e:
        raise ValueError(f"the gateway's CA {path}: {e.strerror} (--tls-ca, or --insecure-plaintext)") from None


def gateway_channel(address: str, tls_ca: str | None = None, insecure_plaintext: bool | None = None) -> grpc.Channel:
    """A channel to a gateway (gateway_credentials)."""
    credentials = gateway_credentials(tls_ca, insecure_plaintext)
    return grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)


def aio_gateway_channel(address: str, tls_ca: str | None = None, insecure_plaintext: bool | None = None):
    """gateway_channel for asyncio."""
    credentials = gateway_credentials(tls_ca, insecure_plaintext)
    return grpc.aio.insecure_channel(address) if credentials is None else grpc.aio.secure_channel(address, credentials)


@functools.cache
def gateway_stub(
    address: str, tls_ca: str | None = None, insecure_plaintext: bool | None = None
) -> gateway_pb2_grpc.GatewayStub:
    """A stub on one shared channel per address."""
    return gateway_pb2_grpc.GatewayStub(gateway_channel(address, tls_ca, insecure_plaintext))


def sampling_params(**kwargs) -> common_pb2.SamplingParams:
    """SamplingParams from keyword arguments (vLLM's names); None leaves a field at its default."""
    return common_pb2.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


def _metadata(api_key: str | None):
    return [("authorization", f"Bearer {api_key}")] if api_key else None


def generate(
    address: str,
    prompt: str | list[int],
    *,
    stream: bool = True,
    api_key: str | None = None,
    tls_ca: str | None = None,
    insecure_plaintext: bool | None = None,
    timeout: float | None = None,
    model: str = "",
    request_id: str = "",
    priority: int = 0,
    **sampling,
) -> Iterator[gateway_pb2.GenerateResponse]:
    """Stream a Generate: the responses as they come (grpc.RpcError on failure; .cancel() ends it). tls_ca and
    insecure_plaintext: as gateway_channel takes them."""
    request = gateway_pb2.GenerateRequest(
        model=model,
        stream=stream,
        request_id=request_id,
        priority=priority,
        sampling_params=sampling_params(**sampling),
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return gateway_stub(address, tls_ca, insecure_plaintext).Generate(
        request, timeout=timeout, metadata=_metadata(api_key)
    )


def chat(
    address: str,
    messages: list[dict],
    *,
    stream: bool = True,
    api_key: str | None = None,
    tls_ca: str | None = None,
    insecure_plaintext: bool | None = None,
    timeout: float | None = None,
    model: str = "",
    **sampling,
) -> Iterator[gateway_pb2.GenerateResponse]:
    """Stream a Chat; messages are {"role", "content"} dicts."""
    request = gateway_pb2.ChatRequest(
        model=model,
        stream=stream,
        sampling_params=sampling_params(**sampling),
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
    )
    return gateway_stub(address, tls_ca, insecure_plaintext).Chat(request, timeout=timeout, metadata=_metadata(api_key))


@dataclass
class GenerateResult:
    """A whole response: the text deltas per choice as they came, and the final message."""

    deltas: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    complete: gateway_pb2.Complete | None = None

    def text(self, index: int = 0) -> str:
        if self.deltas:
            return "".join(self.deltas.get(index, []))
        return next(c.text for c in self.complete.choices if c.index == index)  # stream=False

    def choice(self, index: int = 0) -> gateway_pb2.Choice:
        return next(c for c in self.complete.choices if c.index == index)


def collect(responses) -> GenerateResult:
    result = GenerateResult()
    for response in responses:
        if response.HasField("chunk"):
            for delta in response.chunk.choices:
                result.deltas.setdefault(delta.index, []).append(delta.text)
                result.token_ids.setdefault(delta.index, []).extend(delta.token_ids)
        else:
            result.complete = response.complete
    return result


# ---- the client commands -------------------------------------------------------------------------


def print_stream(responses) -> None:
    started = time.perf_counter()
    first = None
    try:
        for response in responses:
            if response.HasField("chunk"):
                for delta in response.chunk.choices:
                    if delta.index == 0 and delta.text:
                        first = first or time.perf_counter()
                        print(delta.text, end="", flush=True)
            else:
                print(flush=True)
                choice = response.complete.choices[0]
                stop = choice.WhichOneof("stop_reason")
                usage = response.complete.usage
                elapsed = time.perf_counter() - started
                print(
                    f"[finish_reason={choice.finish_reason}"
                    + (f", stop_reason={getattr(choice, stop)!r}" if stop else "")
                    + f", {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens"
                    + (f", first text after {first - started:.2f} s" if first else "")
                    + f", {elapsed:.2f} s in all]",
                    file=sys.stderr,
                )
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(1)


def _sampling_args(args) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop or None,
    )


def run_generate(args: argparse.Namespace) -> None:
    refuse_key_on_command_line(args)
    print_stream(
        generate(
            args.address,
            args.prompt,
            api_key=args.api_key,
            tls_ca=args.tls_ca,
            insecure_plaintext=args.insecure_plaintext,
            timeout=args.timeout,
            model=args.request_model,
            **_sampling_args(args),
        )
    )


def run_chat(args: argparse.Namespace) -> None:
    refuse_key_on_command_line(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}
    ]
    print_stream(
        chat(
            args.address,
            messages,
            api_key=args.api_key,
            tls_ca=args.tls_ca,
            insecure_plaintext=args.insecure_plaintext,
            timeout=args.timeout,
            model=args.request_model,
            **_sampling_args(args),
        )
    )


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser("generate", help="stream a completion from a running gateway")
    add_cli_args(p, GenerateFlags, grouped=False)
    add_cli_args(p, ClientConfig)
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("chat", help="stream a chat reply from a running gateway")
    add_cli_args(p, ChatFlags, grouped=False)
    add_cli_args(p, ClientConfig)
    p.set_defaults(func=run_chat)
