"""Write a GGUF file with the shapes of Qwen2.5-7B and random but valid blocks: the 7B class, measured without a
7B download (issue 82).

    python scripts/write_7b_gguf.py /tmp/scratch                        # /tmp/scratch/qwen2.5-7b-shaped-random.gguf
    python scripts/write_7b_gguf.py /tmp/scratch --tokenizer-from FILE  # the tokenizer of another qwen2 GGUF

28 layers, hidden 3584, FFN 18944, 28 query heads and 4 key/value heads of 128, a 152,064-row vocabulary, the output
layer its own; the tensor types of a llama.cpp Q4_K_M file, about 4.7 GB: those of the tokenizer's file tensor by tensor
where it has as many layers (the store's Qwen2.5 1.5B has 28: Q6_K attn_v and ffn_down in 14 of them, a Q6_K output
layer), else Q4_K with Q6_K for the output layer and for attn_v and ffn_down where llama.cpp's use_more_bits says. The tokenizer is the metadata of a real Qwen2.5 GGUF
(the store's 1.5B by default: the same vocabulary family), its token list padded to the embedding's rows as
llama.cpp pads Qwen's ("[PAD151936]", ... unused). The weights average zero with small scales, so activations stay
finite over 28 layers; what the model says means nothing, only its costs do.

Streamed: the header and every tensor's description first, then one tensor at a time is made and written, so the
memory it takes is about the largest tensor (the output layer, 0.45 GB), never the file. Never write it into the
repository.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
# Q4_K's 12 bytes of 6-bit sub-block scales and minimums with every scale 8 and every minimum 60 (= 7.5 * 8): the
# values are d * (8q - 60), which average zero (tests/gguf_files.py writes the same blocks)
CENTRED_Q4_K_SCALES = np.array([8] * 4 + [60 | 3 << 6] * 4 + [8 | 12 << 4] * 4, dtype=np.uint8)
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


@dataclass(frozen=True)
class Shape:
    layers: int = 28
    hidden: int = 3584
    ffn: int = 18944
    heads: int = 28
    kv_heads: int = 4
    vocab: int = 152064
    context: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


QWEN25_7B = Shape()


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers a Q4_K_M file gives Q6_K attn_v and ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensors(shape: Shape, types: dict[str, str] | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, [rows, columns] or [n], type) of every tensor, in a llama.cpp file's order; types: {name: Q4_K or
    Q6_K} taken over where given (a real Q4_K_M file's of as many layers)."""
    out = _tensors(shape)
    return [(name, dims, (types or {}).get(name, t) if t != "F32" else t) for name, dims, t in out]


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab, s.hidden), "Q4_K")]
    for i in range(s.layers):
        v_type = "Q6_K" if more_bits(i, s.layers) else "Q4_K"
        out += [(f"blk.{i}.attn_norm.weight", (s.hidden,), "F32"),
                (f"blk.{i}.attn_q.weight", (q, s.hidden), "Q4_K"), (f"blk.{i}.attn_q.bias", (q,), "F32"),
                (f"blk.{i}.attn_k.weight", (kv, s.hidden), "Q4_K"), (f"blk.{i}.attn_k.bias", (kv,), "F32"),
                (f"blk.{i}.attn_v.weight", (kv, s.hidden), v_type), (f"blk.{i}.attn_v.bias", (kv,), "F32"),
                (f"blk.{i}.attn_output.weight", (s.hidden, q), "Q4_K"),
                (f"blk.{i}.ffn_norm.weight", (s.hidden,), "F32"),
                (f"blk.{i}.ffn_gate.weight", (s.ffn, s.hidden), "Q4_K"),
                (f"blk.{i}.ffn_up.weight", (s.ffn, s.hidden), "Q4_K"),
                (f"blk.{i}.ffn_down.weight", (s.hidden, s.ffn), v_type)]
    out += [("output_norm.weight", (s.hidden,), "F32"), ("output.weight", (s.vocab, s.hidden), "Q6_K")]
    return out


def nbytes(dims: tuple[int, ...], type_name: str) -> int:
    if type_name == "F32":
        return 4 * int(np.prod(dims))
    rows, k = dims
    return rows * k // QK_K * BLOCK_BYTES[type_name]


def random_blocks(rng: np.random.Generator, dims: tuple[int, int], type_name: str) -> np.ndarray:
    """[rows, bytes a row] of valid blocks whose values average zero, with scales for weights of about
    1 / sqrt(columns) (so a layer keeps its activations' size)."""
    rows, k = dims
    count = rows * k // QK_K
    size = BLOCK_BYTES[type_name]
    blocks = np.frombuffer(rng.bytes(count * size), dtype=np.uint8).reshape(count, size).copy()
    target = 1.0 / np.sqrt(k)  # the weights' spread wanted
    if type_name == "Q4_K":  # values d * (8q - 60), q uniform over 0..15: spread about 37 d
        d = rng.uniform(0.5, 1.5, count).astype(np.float32) * (target / 37)
        scales = d.astype(np.float16).view(np.uint8).reshape(count, 2)
        blocks[:, 0:2] = blocks[:, 2:4] = scales  # d, dmin = d
        blocks[:, 4:16] = CENTRED_Q4_K_SCALES
    else:  # Q6_K: d * scale (int8, uniform) * (q - 32), q uniform over 0..63: spread about 74 * 18.5 d
        d = rng.uniform(0.5, 1.5, count).astype(np.float32) * (target / (74 * 18.5))
        blocks[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, -1)


def float_tensor(rng: np.random.Generator, name: str, n: int) -> np.ndarray:
    if name.endswith(".bias"):
        return rng.normal(0, 0.1, n).astype(np.float32)
    return rng.uniform(0.8, 1.2, n).astype(np.float32)  # a norm's weight


def source_types(path: Path, layers: int) -> dict[str, str]:
    """The Q4_K and Q6_K tensor types of a GGUF file with as many layers, by name ({} for another depth)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("qwen2.block_count")
    if field is None or int(field.contents()) != layers:
        return {}
    return {t.name: t.tensor_type.name for t in reader.tensors if t.tensor_type.name in BLOCK_BYTES}


def tokenizer_fields(path: Path, vocab: int) -> list[tuple[str, object, object, object]]:
    """(key, value, type, sub type) of the tokenizer metadata of a GGUF file, the token list (and its types) padded to
    vocab entries as llama.cpp pads Qwen's."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    if reader.fields.get("general.architecture").contents() != "qwen2":
        raise SystemExit(f"{path}: its tokenizer is not a qwen2 file's")
    out = []
    for key in TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        if isinstance(value, list) and len(value) > vocab and key != "tokenizer.ggml.merges":
            raise SystemExit(f"{path}: its {len(value)} tokens do not fit a {vocab}-row embedding")
        out.append((key, value, field.types[0], sub_type))
    return out


def default_tokenizer() -> Path:
    from draftwise.models import resolve

    return resolve("qwen2.5-coder-1.5b-instruct", progress=False).gguf_path


def write(folder: Path, shape: Shape = QWEN25_7B, tokenizer: Path | None = None, seed: int = 0,
          name: str = "qwen2.5-7b-shaped-random.gguf", progress: bool = True) -> Path:
    import gguf

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tokenizer = tokenizer or default_tokenizer()
    plan = tensors(shape, source_types(tokenizer, shape.layers))
    total = sum(nbytes(dims, t) for _, dims, t in plan)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_type("model")
    writer.add_name("Qwen2.5 7B shaped, random weights (draftwise scripts/write_7b_gguf.py)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub_type in tokenizer_fields(tokenizer, shape.vocab):
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for tensor_name, dims, type_name in plan:
        if type_name == "F32":
            writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32), nbytes(dims, type_name))
        else:  # (the byte shape [rows, bytes a row]: the writer turns it into the values' shape)
            raw = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor_info(tensor_name, (dims[0], nbytes(dims, type_name) // dims[0]), np.dtype(np.uint8),
                                   nbytes(dims, type_name), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    done, start = 0, time.perf_counter()
    for tensor_name, dims, type_name in plan:  # one tensor in memory at a time
        data = float_tensor(rng, tensor_name, dims[0]) if type_name == "F32" else random_blocks(rng, dims, type_name)
        writer.write_tensor_data(data)
        done += data.nbytes
        del data
        if progress and tensor_name.endswith("ffn_down.weight"):
            print(f"\r{done / 1e9:5.2f} of {total / 1e9:.2f} GB, {time.perf_counter() - start:5.1f} s", end="",
                  file=sys.stderr, flush=True)
    writer.close()
    if progress:
        print(file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where to write it (a scratch folder, never the repository)")
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="a qwen2 GGUF whose tokenizer to copy (default: the store's Qwen2.5-Coder 1.5B)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    repository = Path(__file__).resolve().parent.parent
    if args.folder.resolve().is_relative_to(repository):
        parser.error(f"{args.folder} is inside the repository: write the 4.7 GB file to a scratch folder")
    path = write(args.folder, tokenizer=args.tokenizer_from, seed=args.seed)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
