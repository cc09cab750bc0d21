"""Speculative decoding (vLLM v1's spec_decode): proposers of draft tokens, and their acceptance metrics."""
