"""Attention backends behind one seam. The names live here, torch-free, so EngineArgs can check them."""

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")

# --kv-cache-dtype's choices, vLLM's: auto is the model's dtype; fp8 is fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
