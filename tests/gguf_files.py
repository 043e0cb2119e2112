"""Tiny GGUF files written by the tests (the gguf package's GGUFWriter): random but valid blocks, a model's shapes.

write_gguf(path, arch="qwen2") writes a 2-layer decoder with 256-wide rows (whole Q4_K/Q6_K super-blocks) and a
320-token vocabulary; its weights are random blocks with small float16 scales, so activations stay finite.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 320


def raw_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Random blocks of a GGUF type [rows, bytes a row], their float16 scales small and finite."""
    from draftwise.backends import gguf_weights

    size, values, _, _ = gguf_weights.DECODERS[type_name]
    blocks = rng.integers(0, 256, (rows * k // values, size), dtype=np.uint8)
    scales = rng.uniform(scale / 20, scale, (len(blocks), 2)).astype(np.float16).view(np.uint8).reshape(len(blocks), 4)
    if type_name == "Q6_K":
        blocks[:, 208:210] = scales[:, :2]  # d last
    elif type_name == "Q4_K":
        blocks[:, 0:4] = scales[:, :4]
    elif type_name == "Q4_1":
        blocks[:, 0:4] = scales[:, :4]
    else:
        blocks[:, 0:2] = scales[:, :2]
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, arch: str = "qwen2", *, linear: str = "Q4_K", embedding: str = "Q6_K", tied: bool = True,
               seed: int = 0, layers: int = LAYERS, vocab: int = VOCAB, name: str = "tiny", tensors=None,
               metadata=None) -> Path:
    """A GGUF file at path with random blocks; tensors: {name: (array, raw type name or None)} added or replacing;
    metadata: {key: value} strings/ints/floats added."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    planned = {"token_embd.weight": (raw_blocks(embedding, vocab, HIDDEN, rng, 0.5), embedding)}
    for layer in range(layers):
        planned[f"blk.{layer}.attn_norm.weight"] = (rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32), None)
        planned[f"blk.{layer}.ffn_norm.weight"] = (rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32), None)
        for part, (n, k) in shapes.items():
            planned[f"blk.{layer}.{part}.weight"] = (raw_blocks(linear, n, k, rng), linear)
        if arch == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                planned[f"blk.{layer}.{part}.bias"] = (rng.normal(0, 0.1, shapes[part][0]).astype(np.float32), None)
    planned["output_norm.weight"] = (rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32), None)
    if not tied:
        planned["output.weight"] = (raw_blocks(linear, vocab, HIDDEN, rng), linear)
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
