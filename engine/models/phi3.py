"""Phi-3: the Llama decoder, with a checkpoint whose q/k/v and gate/up projections are already fused (qkv_proj,
gate_up_proj), a sliding window on every layer where the config sets one, and LongRoPE (layers.rope_freqs)."""

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights) -> None:
        """Split the checkpoint's fused tensors into the q/k/v and gate/up parts they hold, so each rank takes its
        heads of q, of k and of v (and its share of gate and of up), as from a Llama checkpoint."""
        config = self.config
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim

        def split(weights):
            for name, tensor in weights:
                if ".qkv_proj." in name:
                    parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]))
                elif ".gate_up_proj." in name:
                    parts = zip(("gate_proj", "up_proj"), tensor.chunk(2))
                else:
                    yield name, tensor
                    continue
                fused = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
                for part, t in parts:
                    yield name.replace(fused, part), t

        super().load_weights(split(weights))
