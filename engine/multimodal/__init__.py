"""Multi-modal inputs (vLLM's vllm.multimodal): what an image becomes before it enters the engine core (processed
tensors, its placeholder range in the prompt's token ids, its content hash), and the encoder cache's bookkeeping."""
