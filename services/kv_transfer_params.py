"""vLLM's kv_transfer_params for disaggregated prefill, as the gateway sends them and the engine service reads them.

The gateway sends REMOTE_DECODE_PARAMS to a kv_producer engine, which answers REMOTE_PREFILL_PARAMS once the prompt's
blocks are in the kvstore; the gateway hands that (or, when the producer failed, the same value) to the kv_consumer,
which loads the blocks by their hashes, so nothing else needs to travel.
"""

import json

from engine.json_object import parse_json_object

# The keys an engine reads.
KV_TRANSFER_KEYS = ("do_remote_decode", "do_remote_prefill")
MAX_KV_TRANSFER_PARAMS_CHARS = 1024
REMOTE_DECODE_PARAMS = json.dumps({"do_remote_decode": True}, separators=(",", ":"))
REMOTE_PREFILL_PARAMS = json.dumps({"do_remote_prefill": True, "do_remote_decode": False}, separators=(",", ":"))


def parse_kv_transfer_params(text: str, kv_role: str | None) -> dict:
    """EngineGenerateRequest.kv_transfer_params -> its flags; ValueError naming the field and what it allows."""
    if not text:
        return {}
    if len(text) > MAX_KV_TRANSFER_PARAMS_CHARS:
        raise ValueError(f"kv_transfer_params: at most {MAX_KV_TRANSFER_PARAMS_CHARS} characters, got {len(text)}.")
    params = parse_json_object(text, "kv_transfer_params", KV_TRANSFER_KEYS)
    for key, value in params.items():
        if not isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{key} must be true or false, got {value!r}.")
    if params.get("do_remote_decode") and kv_role != "kv_producer":
        raise ValueError(
            f"kv_transfer_params.do_remote_decode needs an engine with kv_role kv_producer; this one's is {kv_role}."
        )
    if params.get("do_remote_prefill") and kv_role not in ("kv_consumer", "kv_both"):
        raise ValueError(
            "kv_transfer_params.do_remote_prefill needs an engine with kv_role kv_consumer or kv_both; "
            f"this one's is {kv_role}."
        )
    return params
