"""Tiny GGUF files written by the tests (the gguf package's GGUFWriter): random but valid blocks, a model's shapes.

write_gguf(path, arch="qwen2") writes a 2-layer decoder with 256-wide rows (whole Q4_K/Q6_K super-blocks) and a
320-token vocabulary; its weights are random blocks with small float16 scales, so activations stay finite. Each
architecture gets the tensors and metadata llama.cpp's converter writes for it (ARCHS): "mistral" is a llama file
whose name says Mistral (as llama.cpp writes Mistral 7B), qwen3 adds q/k norms, gemma3 its four norms a layer, q/k
norms, a sliding window over five layers of six (so it is 6 layers deep), phi3 fused qkv and gate/up tensors.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 320
# arch -> (the file's general.architecture, head dimension, layers, the per-layer tensors beyond llama's, metadata)
ARCHS = {
    "qwen2": ("qwen2", 64, LAYERS, ("attn_q.bias", "attn_k.bias", "attn_v.bias"), {}),
    "llama": ("llama", 64, LAYERS, (), {}),
    # (Mistral Nemo's head dimension is not hidden / heads either: llama.cpp writes it as the rotary dimension)
    "mistral": ("llama", 128, LAYERS, (), {"rope_dimension_count": 128}),
    # Qwen3's head dimension is its own (128 in every Qwen3), not hidden / heads
    "qwen3": ("qwen3", 128, LAYERS, ("attn_q_norm", "attn_k_norm"), {"key_length": 128}),
    "gemma3": ("gemma3", 64, 6, ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"),
               {"key_length": 64, "sliding_window": 4}),
    # (Phi-3's config pads with id 32000 unless the file says otherwise, as llama.cpp's Phi-3 files do)
    "phi3": ("phi3", 64, LAYERS, ("fused",), {"eos_token_id": 2, "padding_token_id": 0}),
}


# Q4_K's 12 bytes of 6-bit sub-block scales and minimums with every scale 8 and every minimum 60 (= 7.5 * 8)
CENTRED_Q4_K_SCALES = np.array([8] * 4 + [60 | 3 << 6] * 4 + [8 | 12 << 4] * 4, dtype=np.uint8)


def raw_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, scale: float = 0.02,
               centred: bool = False) -> np.ndarray:
    """Random blocks of a GGUF type [rows, bytes a row], their float16 scales small and finite. centred: Q4_K
    blocks whose minimum is the middle of their range (d * (8q - 60), dmin = d), and Q4_1 blocks with a minimum of
    -8d, so the weights average zero: random weights with an offset make every row alike, and a model that repeats
    one token whatever it is given (a weak test of a forward)."""
    from draftwise.backends import gguf_weights

    size, values, _, _ = gguf_weights.DECODERS[type_name]
    blocks = rng.integers(0, 256, (rows * k // values, size), dtype=np.uint8)
    scales = rng.uniform(scale / 20, scale, (len(blocks), 2)).astype(np.float16).view(np.uint8).reshape(len(blocks), 4)
    if centred and type_name == "Q4_K":
        blocks[:, 0:2] = blocks[:, 2:4] = scales[:, :2]  # dmin = d
        blocks[:, 4:16] = CENTRED_Q4_K_SCALES
    elif centred and type_name == "Q4_1":
        d = scales[:, :2].copy().view(np.float16)
        blocks[:, 0:2], blocks[:, 2:4] = scales[:, :2], (-8 * d).astype(np.float16).view(np.uint8)
    elif type_name == "Q6_K":
        blocks[:, 208:210] = scales[:, :2]  # d last
    elif type_name == "Q4_K":
        blocks[:, 0:4] = scales[:, :4]
    elif type_name == "Q4_1":
        blocks[:, 0:4] = scales[:, :4]
    else:
        blocks[:, 0:2] = scales[:, :2]
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, arch: str = "qwen2", *, linear: str = "Q4_K", embedding: str = "Q6_K", tied: bool = True,
               seed: int = 0, layers: int | None = None, vocab: int = VOCAB, name: str = "tiny", tensors=None,
               metadata=None, centred: bool = False) -> Path:
    """A GGUF file at path with random blocks; tensors: {name: (array, raw type name or None)} added or replacing;
    metadata: {key: value} strings/ints/floats added; centred: weights that average zero, with small scales
    (raw_blocks), for a model whose tokens depend on its input."""
    import gguf

    rng = np.random.default_rng(seed)
    # (an architecture not listed: llama's tensors under its name, for files that are refused)
    file_arch, head_dim, arch_layers, extra, arch_metadata = ARCHS.get(arch, (arch, 64, LAYERS, (), {}))
    layers = arch_layers if layers is None else layers
    writer = gguf.GGUFWriter(str(path), file_arch)
    writer.add_name("Mistral-7B-Instruct-v0.3" if arch == "mistral" else name)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    if "key_length" in arch_metadata:
        writer.add_key_length(arch_metadata["key_length"])
        writer.add_value_length(arch_metadata["key_length"])
    if "rope_dimension_count" in arch_metadata:
        writer.add_rope_dimension_count(arch_metadata["rope_dimension_count"])
    if "eos_token_id" in arch_metadata:
        writer.add_eos_token_id(arch_metadata["eos_token_id"])
        writer.add_pad_token_id(arch_metadata["padding_token_id"])
    if "sliding_window" in arch_metadata:
        writer.add_sliding_window(arch_metadata["sliding_window"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    q, kv = HEADS * head_dim, KV_HEADS * head_dim
    shapes = {"attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, q),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    if "fused" in extra:  # Phi-3: one qkv projection, one gate-and-up projection (gate rows first)
        del shapes["attn_q"], shapes["attn_k"], shapes["attn_v"], shapes["ffn_gate"]
        shapes = {"attn_qkv": (q + 2 * kv, HIDDEN), **shapes, "ffn_up": (2 * FFN, HIDDEN)}
    weight_scale, embedding_scale = (0.002, 0.004) if centred else (0.02, 0.5)

    def blocks(type_name: str, n: int, k: int, scale: float = weight_scale) -> np.ndarray:
        return raw_blocks(type_name, n, k, rng, scale, centred)

    planned = {"token_embd.weight": (blocks(embedding, vocab, HIDDEN, embedding_scale), embedding)}
    for layer in range(layers):
        planned[f"blk.{layer}.attn_norm.weight"] = (rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32), None)
        planned[f"blk.{layer}.ffn_norm.weight"] = (rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32), None)
        for part, (n, k) in shapes.items():
            planned[f"blk.{layer}.{part}.weight"] = (blocks(linear, n, k), linear)
        for part in extra:
            if part.endswith(".bias"):
                rows = shapes[part.split(".")[0]][0]
                planned[f"blk.{layer}.{part}"] = (rng.normal(0, 0.1, rows).astype(np.float32), None)
            elif part != "fused":  # a norm: over a head (q/k norms) or the hidden rows
                width = head_dim if part in ("attn_q_norm", "attn_k_norm") else HIDDEN
                planned[f"blk.{layer}.{part}.weight"] = (rng.uniform(0.8, 1.2, width).astype(np.float32), None)
    planned["output_norm.weight"] = (rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32), None)
    if not tied:
        planned["output.weight"] = (blocks(linear, vocab, HIDDEN), linear)
    planned.update(tensors or {})
    for tensor_name, (array, type_name) in planned.items():
        if array is None:
            continue
        if type_name is None:
            writer.add_tensor(tensor_name, array)
        else:
            writer.add_tensor(tensor_name, array, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
