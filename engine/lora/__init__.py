"""Multi-LoRA serving (vLLM's design): PEFT adapters loaded into fixed device slots, many adapters in one batch.

request.py: LoRARequest, what a request names. registry.py: the adapters an engine has loaded, by name. peft.py:
reading and checking a PEFT directory. layers.py: the wrapper around a Linear that adds each token's adapter delta.
manager.py: the slots and the two LRUs.
"""
