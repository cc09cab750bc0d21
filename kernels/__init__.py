"""Attention kernels that read the paged KV cache in place: Triton (GPU, and CPU under TRITON_INTERPRET=1)
and a C++ CPU kernel. Each has a plain torch reference in kernels/reference.py and is tested against it.

Every kernel shares the engine's cache layout, [num_kv_heads, num_blocks, block_size, head_dim] per layer
for K and for V, and its batch contract (engine.attention.backend.AttentionMetadata): a flat batch of
query tokens, request r owning rows query_start_loc[r]:query_start_loc[r+1], whose last query token sits
at position seq_lens[r] - 1 and sees keys 0..its own position (causal). A slot of -1 is padding: nothing
is written. A request with no query rows is skipped.
"""
