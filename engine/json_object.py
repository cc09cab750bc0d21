"""parse_json_object: a setting or request field given as a JSON object (the KV transfer and speculative configs,
kv_transfer_params), read the same way everywhere. Torch-free: the engine's config imports it."""

import json


def parse_json_object(text: str, name: str, keys) -> dict:
    """text as a JSON object with none but these keys; ValueError naming `name` and the keys it allows."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name} must be a JSON object.")
    unknown = set(data) - set(keys)
    if unknown:
        raise ValueError(f"{name} has unknown keys {sorted(unknown)}; allowed: {', '.join(keys)}.")
    return data
