"""GGUF files of Qwen3, Phi-3, Gemma 2 and Gemma 3, written as llama.cpp's convert_hf_to_gguf.py writes them from a
tiny random Hugging Face model, converted by the engine and checked against transformers' own GGUF loader on the
same file (config, every tensor, the tokenizer and its chat template) and against the model they came from."""

from pathlib import Path

import chat_templates
import numpy as np
import pytest
import torch

from engine.models import files, loader
from engine.models.config import ModelLoadError
from engine.models.files import load_tokenizer
from engine.models.loader import load_weights

# ---------------------------------------------------------------------------------------------- tiny vocabularies


def _byte_level_vocab(specials: dict[str, int]) -> dict:
    """A gpt2 (byte-level BPE) vocabulary as llama.cpp writes Qwen's: every byte, a few merges, the added tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i s", "Ġ a", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "e l", "el l", "h ell"]
    tokens = byte_chars + ["".join(m.split(" ")) for m in merges] + list(specials)
    types = [1] * (len(tokens) - len(specials)) + list(specials.values())
    return {"model": "gpt2", "pre": "qwen2", "tokens": tokens, "types": types, "merges": merges}


def _sentencepiece_vocab(specials: list[str], control: set[str]) -> dict:
    """A sentencepiece ("llama") vocabulary: special tokens first, then pieces with falling scores."""
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *".,!?'\n:", "▁t", "▁a", "he", "▁the",
              "is", "▁is", "or", "ld", "▁w", "▁wor", "▁world", "el", "ell", "▁h", "▁hell", "▁hello", "▁H", "▁Hello"]  # fmt: skip
    tokens = specials + pieces
    types = [3 if t in control else 2 if t == "<unk>" else 1 for t in specials] + [1] * len(pieces)
    scores = [0.0] * len(specials) + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores}


_QWEN_SPECIALS = {"<|endoftext|>": 3, "<|im_start|>": 3, "<|im_end|>": 3, "<think>": 4, "</think>": 4}
_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_PHI3_SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]


def _vocab(family: str) -> dict:
    if family == "qwen3":
        return _byte_level_vocab(_QWEN_SPECIALS)
    if family == "phi3":
        return _sentencepiece_vocab(_PHI3_SPECIALS, set(_PHI3_SPECIALS) - {"<unk>"})
    return _sentencepiece_vocab(_GEMMA_SPECIALS, set(_GEMMA_SPECIALS) - {"<unk>"})


# ---------------------------------------------------------------------------------------------- tiny models


def _tiny_model(family: str, vocab_size: int, **overrides):
    """A random HF model of `family`; every parameter random (norms too, so a wrong +1 or permutation shows)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    if family == "qwen3":
        # transformers' GGUF loader does not read qwen3's key_length, so its default head_dim (128) is used here.
        config = transformers.Qwen3Config(**common, head_dim=128, tie_word_embeddings=True, rope_theta=1e6,
                                          bos_token_id=None, eos_token_id=271, pad_token_id=269)  # fmt: skip
        cls = transformers.Qwen3ForCausalLM
    elif family == "phi3":
        # transformers' GGUF loader does not read the original context length: its default (4096) here.
        config = transformers.Phi3Config(**common, original_max_position_embeddings=4096, tie_word_embeddings=False,
                                         bos_token_id=1, eos_token_id=5, pad_token_id=3)  # fmt: skip
        cls = transformers.Phi3ForCausalLM
    elif family == "gemma2":
        # head_dim and query_pre_attn_scalar as Gemma 2 2B/9B (transformers' GGUF loader assumes these defaults).
        config = transformers.Gemma2Config(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1},
                                           head_dim=256, sliding_window=8, bos_token_id=2, eos_token_id=1,
                                           pad_token_id=0)  # fmt: skip
        cls = transformers.Gemma2ForCausalLM
    else:
        # Six layers: Gemma 3 slides on five of every six.
        config = transformers.Gemma3TextConfig(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1,
                                                  "num_hidden_layers": 6},
                                               head_dim=256, sliding_window=8, bos_token_id=2, eos_token_id=1,
                                               pad_token_id=0)  # fmt: skip
        cls = transformers.Gemma3ForCausalLM
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


_GGUF_ARCH = {"qwen3": "QWEN3", "phi3": "PHI3", "gemma2": "GEMMA2", "gemma3": "GEMMA3"}
_TEMPLATES = {"qwen3": chat_templates.QWEN3, "phi3": chat_templates.PHI3, "gemma2": chat_templates.GEMMA2,
              "gemma3": chat_templates.GEMMA3}  # fmt: skip


def write_gguf(path: Path, family: str, model, vocab: dict, quantized: bool = False) -> None:
    """`model` as llama.cpp's converter writes it: its metadata keys, tensor names (gguf-py's map, which the converter
    uses), Gemma's norms as 1 + w, no q/k permutation (only its llama converter permutes), tied lm_head left out."""
    import gguf

    c = model.config
    arch = gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, _GGUF_ARCH[family])]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if family != "phi3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if family == "phi3":
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
        w.add_sliding_window(c.sliding_window or 0)
    if family == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if family in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
    # The tokenizer, as gguf.SpecialVocab and the converter's set_vocab write it.
    w.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    for kind in ("bos", "eos", "pad"):
        token_id = getattr(c, f"{kind}_token_id")
        if token_id is not None:
            getattr(w, f"add_{kind}_token_id")(token_id)
    if family in ("gemma2", "gemma3"):
        w.add_unk_token_id(3)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
    w.add_chat_template(_TEMPLATES[family])

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, _GGUF_ARCH[family]), c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, _, kind = hf_name.rpartition(".")
        data = t.float().numpy()
        if family.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1
        name = f"{names.get_name(base)}.{kind}"
        if quantized and data.ndim == 2:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert(path: Path) -> tuple[dict, dict, Path]:
    """The engine's conversion of a GGUF: (config.json dict, float32 weights, directory with the tokenizer)."""
    reader = files.open_gguf(path)
    config = files.gguf_config(reader, path)
    out = path.parent / "converted"
    out.mkdir()
    loader._write_weights(reader, config, out)
    files.write_text_files(reader, path, config, out)
    return config, dict(load_weights(out, dequantized=True)), out


def transformers_gguf(path: Path, monkeypatch):
    """The model and tokenizer of transformers' own GGUF loader on the same file."""
    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers refuses GGUF without `accelerate` installed, but its GGUF path does not use it on CPU.
    monkeypatch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda *a, **k: True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _rope_theta(config) -> float:
    rope = config.rope_parameters
    return rope.get("full_attention", rope)["rope_theta"]


# Config fields whose values the file determines, for each family beyond the common ones.
_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
           "bos_token_id", "eos_token_id"]  # fmt: skip
_FAMILY_FIELDS = {
    "qwen3": [],
    "phi3": ["original_max_position_embeddings", "sliding_window"],
    "gemma2": ["sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
               "final_logit_softcapping", "hidden_activation"],
    "gemma3": ["sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
               "attn_logit_softcapping", "hidden_activation"],
}  # fmt: skip
FAMILIES = list(_FAMILY_FIELDS)


def check_config(ours: dict, theirs, family: str) -> None:
    for name in _FIELDS + _FAMILY_FIELDS[family]:
        if name == "head_dim" and family == "phi3":  # Phi-3's config has none
            expected = theirs.hidden_size // theirs.num_attention_heads
        else:
            expected = getattr(theirs, name)
        if isinstance(expected, float):  # GGUF keeps float32
            expected = pytest.approx(expected, rel=1e-7)
        assert ours[name] == expected, (name, ours[name], expected)
    assert ours["rope_theta"] == pytest.approx(_rope_theta(theirs), rel=1e-7)
    if family == "gemma3":
        assert ours["rope_local_base_freq"] == theirs.rope_parameters["sliding_attention"]["rope_theta"]


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_matches_transformers_gguf_loader(tmp_path, monkeypatch, family, quantized):
    vocab = _vocab(family)
    original = _tiny_model(family, len(vocab["tokens"]))
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, family, original, vocab, quantized)

    config, ours, out = convert(path)
    ref, ref_tok = transformers_gguf(path, monkeypatch)
    assert config["architectures"] == [type(original).__name__]
    check_config(config, ref.config, family)
    check_config(config, original.config, family)

    expected = ref.state_dict()
    tied = config["tie_word_embeddings"]
    assert set(ours) == set(expected) - ({"lm_head.weight"} if tied else set())
    source = original.state_dict()
    for name, t in ours.items():
        assert t.dtype == torch.float32 and torch.equal(t, expected[name]), name
        if not quantized:  # and the weights the file was made from (Gemma's norms through 1 + w - 1 in float32)
            atol = 1e-6 if name.endswith("norm.weight") and family.startswith("gemma") else 0
            torch.testing.assert_close(t, source[name], rtol=0, atol=atol, msg=name)

    # The tokenizer and its chat template: the same ids as transformers' tokenizer from the same file.
    tok = load_tokenizer(out)
    assert tok.chat_template == ref_tok.chat_template == _TEMPLATES[family]
    for text in ("hello world", "Hello the world is hell!", " a  b\nc"):
        assert tok.encode(text) == ref_tok.encode(text), text
    chat = [{"role": "user", "content": "hello world"}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.encode(prompt, add_special_tokens=False) == ref_tok.encode(prompt, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------- what only llama.cpp says


def test_gemma3_rope_scaling_local_base_and_pattern(tmp_path):
    """Gemma 3 4B+'s linear rope scaling (its global layers only, as in HF's config), the local rope base and
    a layer pattern the file states, none of which transformers' GGUF loader reads."""
    import gguf

    vocab = _vocab("gemma3")
    model = _tiny_model("gemma3", len(vocab["tokens"]))
    path = tmp_path / "g.gguf"
    write_gguf(path, "gemma3", model, vocab)
    raw = gguf.GGUFReader(str(path))
    rewritten = tmp_path / "scaled" / "g.gguf"
    rewritten.parent.mkdir()
    _copy_with(raw, rewritten, {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
                                "gemma3.rope.freq_base_swa": 20000.0, "gemma3.attention.sliding_window_pattern": 3,
                                "gemma3.final_logit_softcapping": 30.0})  # fmt: skip
    config = files.gguf_config(files.open_gguf(rewritten), rewritten)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert config["rope_local_base_freq"] == 20000.0 and config["final_logit_softcapping"] == 30.0
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"] * 2


def test_phi3_long_rope_window_and_partial_rotary(tmp_path):
    vocab = _vocab("phi3")
    model = _tiny_model("phi3", len(vocab["tokens"]))
    path = tmp_path / "p.gguf"
    write_gguf(path, "phi3", model, vocab)
    import gguf

    long, short = np.linspace(1, 4, 4, dtype=np.float32), np.linspace(1, 2, 4, dtype=np.float32)
    rewritten = tmp_path / "long" / "p.gguf"
    rewritten.parent.mkdir()
    _copy_with(gguf.GGUFReader(str(path)), rewritten,
               {"phi3.attention.sliding_window": 2047, "phi3.rope.dimension_count": 8,
                "phi3.rope.scaling.attn_factor": 1.19},
               {"rope_factors_long.weight": long, "rope_factors_short.weight": short})  # fmt: skip
    config, weights, _ = convert(rewritten)
    assert config["sliding_window"] == 2047 and config["partial_rotary_factor"] == 0.5
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and scaling["attention_factor"] == pytest.approx(1.19)
    assert scaling["long_factor"] == long.tolist() and scaling["short_factor"] == short.tolist()
    assert not any("rope" in name for name in weights)


def test_unimplemented_metadata_is_refused_by_name(tmp_path):
    import gguf

    vocab = _vocab("qwen3")
    model = _tiny_model("qwen3", len(vocab["tokens"]))
    path = tmp_path / "q.gguf"
    write_gguf(path, "qwen3", model, vocab)
    for i, (key, value) in enumerate(
        [("qwen3.expert_count", 8), ("qwen3.attention.value_length", 64), ("qwen3.rope.dimension_count", 32)]
    ):
        bad = tmp_path / str(i) / "q.gguf"
        bad.parent.mkdir()
        _copy_with(gguf.GGUFReader(str(path)), bad, {key: value})
        with pytest.raises(ModelLoadError, match=rf"{key}={value}"):
            files.gguf_config(files.open_gguf(bad), bad)


def _copy_with(reader, out: Path, meta: dict, tensors: dict | None = None) -> None:
    """A copy of a GGUF file with metadata keys set (or replaced) and tensors added."""
    import gguf

    arch = files._field(reader, "general.architecture")
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    for key, value in meta.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    for name, data in (tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------- served end to end


def served_gguf(tmp_path, monkeypatch, family: str, quantized: bool = False):
    """A family's GGUF for a test that runs the engine or a service on it (skipped where the family is not
    implemented in this tree), with the conversion cache under tmp_path: (path, transformers' model, tokenizer)."""
    from engine.models.registry import ModelRegistry

    if not ModelRegistry.is_supported(files.GGUF_ARCHS[family]):
        pytest.skip(f"{files.GGUF_ARCHS[family]} is not implemented in this tree")
    vocab = _vocab(family)
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, family, _tiny_model(family, len(vocab["tokens"])), vocab, quantized)
    monkeypatch.setenv("LLMMESH_CACHE_DIR", str(tmp_path / "cache"))
    return path, *transformers_gguf(path, monkeypatch)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_serving_the_gguf_matches_transformers(tmp_path, monkeypatch, family):
    from conftest import HFReference, assert_greedy_matches, run_greedy
    from engine.config import EngineArgs
    from engine.core import EngineCore

    # Q8_0 linear layers: the engine keeps them quantized (their dequantized values are checked above).
    path, ref, _ = served_gguf(tmp_path, monkeypatch, family, quantized=True)
    vocab = _vocab(family)

    engine = EngineCore(EngineArgs(model=str(path), dtype="float32", kv_cache_memory="8MiB", block_size=4))
    rng = np.random.default_rng(1)
    # Longer than the Gemma models' 8-token window, so the sliding layers slide.
    prompts = [rng.integers(10, len(vocab["tokens"]) - 10, n).tolist() for n in (3, 13, 21)]
    reference = HFReference(ref)
    for i, (prompt, ours) in enumerate(zip(prompts, run_greedy(engine, prompts, 10))):
        tokens, logits = reference.greedy(prompt, len(ours))
        assert_greedy_matches(ours, tokens, logits, f"{family} prompt {i}")
