"""A random-weight model of SmolLM2-135M's shape, saved as a Hugging Face directory with a tokenizer.

For machines that cannot carry the real weights (the GPU ones): the same architecture (30 layers, GQA 9/3,
head_dim 64, vocabulary 49152) does the same work per token, so it serves benchmarks and exactness tests
(greedy against transformers on the same weights). Its tokenizer maps id i to the word "<i>".

Test support, so not in the product package: it sits beside the tests, which import it as they import
test_models (pytest puts tests/ on the path), and the benchmarks that use it put tests/ on their path, as some
already put their own folder there. Nothing is installed for it.
"""

from pathlib import Path

import torch

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def save_random_smollm2_shaped(path: Path, seed: int = 0, **shape):
    """Write config, weights (float32) and tokenizer to path; the transformers model (float32, on CPU). `shape`
    overrides SMOLLM2_SHAPE's entries (a smaller model for fast tests)."""
    import transformers

    # A wider init than the default 0.02 gives logits with clear winners, so greedy choices are rarely near-ties.
    config = transformers.LlamaConfig(**{**SMOLLM2_SHAPE, "initializer_range": 0.05, **shape})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    save_word_level_tokenizer(path, config.vocab_size)
    return model


def save_word_level_tokenizer(path: Path, vocab_size: int) -> None:
    """A tokenizer that maps id i to the word "<i>" (BOS 1, EOS 2), saved to path."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<0>", bos_token="<1>", eos_token="<2>", pad_token="<0>"
    )
    tokenizer.save_pretrained(path)
