"""Phi-3: the Llama decoder, with a checkpoint whose q/k/v and gate/up projections are already fused (qkv_proj,
gate_up_proj), a sliding window on every layer where the config sets one, and LongRoPE (short factors up to
original_max_position_embeddings, long ones for a sequence past it: layers.LongRoPERotaryEmbedding)."""

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights) -> None:
        """Split the checkpoint's fused tensors into the q/k/v and gate/up parts they hold, so each rank takes its
        heads of q, of k and of v (and its share of gate and of up), as from a Llama checkpoint."""
        config = self.config
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        # The checkpoint's fused projection -> the projections it holds, and their rows.
        fused = {
            "qkv_proj": (("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
            "gate_up_proj": (("gate_proj", "up_proj"), [config.intermediate_size] * 2),
        }

        def split(weights):
            for name, tensor in weights:
                *path, module, param = name.split(".")
                if module not in fused:
                    yield name, tensor
                    continue
                names, rows = fused[module]
                for part, t in zip(names, tensor.split(rows)):
                    yield ".".join([*path, part, param]), t

        super().load_weights(split(weights))
