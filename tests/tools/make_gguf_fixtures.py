#!/usr/bin/env python3
"""Generates the GGUF reference fixtures in tests/data/gguf/ from independent tools.

Run once, by hand, when the fixtures must change; the outputs are committed and the C++ tests
(tests/test_gguf.cpp) only read them. Nothing here runs at test time.

    python3 -m venv .venv-fixtures
    CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
        .venv-fixtures/bin/pip install -r tests/requirements-fixtures.txt   # builds llama.cpp
    scripts/fetch-model.sh
    .venv-fixtures/bin/python tests/tools/make_gguf_fixtures.py

What it writes (docs/gguf.md explains the method):

  synth_<type>.gguf        one tensor 'weight' of 4 rows x 256 for each of F32, F16, BF16, Q8_0,
                           Q4_0, Q4_1 (written by gguf.GGUFWriter, quantized by
                           gguf.quants.quantize) and Q4_K, Q6_K (random raw blocks with finite
                           fp16 scales: gguf-py has no quantizer for them)
  synth_metadata.gguf      every metadata value type, arrays of strings, nested arrays,
                           general.alignment = 64 and two small tensors
  synth_qwen2.gguf         a tiny qwen2 model description (config + tokenizer keys, tiny tensors)
  dequant_reference.json   for each synthetic file and for tensors of each type present in the
                           SmolLM2 file (F32, Q4_1, Q8_0): spans of raw bytes with the float32
                           bit patterns that gguf.quants.dequantize gives, and a checksum of the
                           whole dequantized tensor
  metadata_reference.json  the values written into synth_metadata.gguf and synth_qwen2.gguf
  llama_cpp_reference.json llama.cpp (through llama-cpp-python) on the SmolLM2 file: vocab facts,
                           token ids of a text corpus, and for 3 chat prompts the last-position
                           logits (top 64 + L2 norm) and a 32-token greedy continuation

The checksum ("weighted_sum") of a float tensor is sum_i bits[i] * (2 i + 1) mod 2^64, bits[i]
the float32 bit pattern of element i: any change to any one element changes it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import re
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"
DEFAULT_OUT = ROOT / "tests" / "data" / "gguf"
SEED = 20250207
ROWS, COLS = 4, 256

TEXT_CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\n\n\ttabbed line\r\n",
    "Numbers: 0 7 42 1234567 3.14159 -2.5e10 1,000,000",
    "I'm sure you'll see they've done it, haven't they? It's 'quoted' and \"double quoted\".",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Unicode: café naïve résumé Ångström — “smart quotes” … ß",
    "日本語のテキストと中文文本，한국어 텍스트.",
    "Emoji 🚀🔥👍🏽 and symbols ∑∫√≠ ©®™",
    "<|im_start|>user is plain text here<|im_end|>",
    "https://example.com/path?query=1&other=two#frag email@example.org",
    "",
    "a" * 40,
]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in one sentence what a CPU does.",
]
N_GREEDY = 32
TOP_K = 64
LLAMA_SEED = 1234


# --- helpers ---------------------------------------------------------------------------------

def weighted_sum(values: np.ndarray) -> int:
    """sum_i bits[i] * (2 i + 1) mod 2^64 over the float32 bit patterns, in element order."""
    bits = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    total = np.uint64(0)
    chunk = 1 << 22
    with np.errstate(over="ignore"):
        for start in range(0, bits.size, chunk):
            part = bits[start:start + chunk]
            weights = np.arange(start, start + part.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
            total = total + np.sum(part * weights, dtype=np.uint64)
    return int(total)


def tensor_bytes(reader: gguf.GGUFReader, t) -> np.ndarray:
    """The tensor's raw bytes as uint8 rows (n_rows, row_bytes), straight from the file."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    row_len = int(t.shape[0])
    n_rows = int(t.n_elements) // row_len
    row_bytes = row_len // block_size * type_size
    start = int(t.data_offset)
    raw = np.asarray(reader.data[start:start + n_rows * row_bytes], dtype=np.uint8)
    assert raw.size == int(t.n_bytes), (t.name, raw.size, int(t.n_bytes))
    return raw.reshape(n_rows, row_bytes)


def dequantize_tensor(reader: gguf.GGUFReader, t) -> tuple[np.ndarray, np.ndarray]:
    raw = tensor_bytes(reader, t)
    values = gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32, copy=False)
    return raw.reshape(-1), values.reshape(-1)


def span_entry(raw: np.ndarray, values: np.ndarray, qtype: QT, first_element: int, n_elements: int) -> dict:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert first_element % block_size == 0 and n_elements % block_size == 0
    b0 = first_element // block_size * type_size
    b1 = b0 + n_elements // block_size * type_size
    bits = values[first_element:first_element + n_elements].view(np.uint32)
    return {
        "first_element": first_element,
        "n_elements": n_elements,
        "byte_offset": b0,
        "raw": raw[b0:b1].tobytes().hex(),
        "bits": [int(b) for b in bits],
    }


def tensor_entry(file_label: str, reader: gguf.GGUFReader, name: str, span_starts: list[int], span_len: int) -> dict:
    t = next(x for x in reader.tensors if x.name == name)
    raw, values = dequantize_tensor(reader, t)
    block_size, _ = gguf.GGML_QUANT_SIZES[t.tensor_type]
    n = values.size
    spans = []
    for start in span_starts:
        start = n - span_len if start < 0 else start
        start -= start % block_size
        spans.append(span_entry(raw, values, t.tensor_type, start, span_len))
    return {
        "file": file_label,
        "tensor": name,
        "type": t.tensor_type.name,
        "shape": [int(s) for s in t.shape],
        "n_bytes": int(t.n_bytes),
        "spans": spans,
        "weighted_sum": str(weighted_sum(values)),
        "finite": bool(np.isfinite(values).all()),
    }


# --- synthetic tensors -----------------------------------------------------------------------

def synth_values(rng: np.random.Generator) -> np.ndarray:
    x = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
    x[1, :32] = 0.0                           # an all-zero block: scale 0
    x[2, 5] = 1.75                            # an outlier dominates its block's scale
    x[3, 32:64] = np.linspace(-1.0, 1.0, 32)  # a ramp across a whole block
    return x


def special_f16_bits() -> list[int]:
    # +0, -0, smallest and largest subnormal, smallest normal, 1, -2, max, +inf, -inf, quiet NaN
    return [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xC000, 0x7BFF, 0x7C00, 0xFC00, 0x7E00]


def special_bf16_bits() -> list[int]:
    # +0, -0, subnormal, smallest normal, 1, -2, max, +inf, -inf, quiet NaN
    return [0x0000, 0x8000, 0x0001, 0x0080, 0x3F80, 0xC000, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0]


def random_fp16(rng: np.random.Generator, n: int, lo: float, hi: float, signed: bool) -> np.ndarray:
    v = rng.uniform(lo, hi, n)
    if signed:
        v *= rng.choice([-1.0, 1.0], n)
    return v.astype(np.float16)


def raw_q4_k(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    # block_q4_K: d (fp16), dmin (fp16), scales[12], qs[128]  -> 144 bytes
    blocks = np.zeros((n_blocks, 144), dtype=np.uint8)
    blocks[:, 0:2] = random_fp16(rng, n_blocks, 1e-4, 2e-2, signed=False).view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 2:4] = random_fp16(rng, n_blocks, 1e-4, 2e-2, signed=False).view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 4:] = rng.integers(0, 256, (n_blocks, 140), dtype=np.uint8)
    return blocks


def raw_q6_k(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    # block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16)  -> 210 bytes
    blocks = np.zeros((n_blocks, 210), dtype=np.uint8)
    blocks[:, :208] = rng.integers(0, 256, (n_blocks, 208), dtype=np.uint8)
    blocks[:, 208:210] = random_fp16(rng, n_blocks, 1e-4, 1e-2, signed=True).view(np.uint8).reshape(n_blocks, 2)
    return blocks


def write_single_tensor_file(path: Path, qtype: QT, rng: np.random.Generator) -> None:
    w = gguf.GGUFWriter(str(path), "duet_fixture")
    w.add_string("duet.fixture", f"one {qtype.name} tensor 'weight' of {ROWS} rows x {COLS}")
    x = synth_values(rng)
    if qtype == QT.F32:
        w.add_tensor("weight", x)
    elif qtype == QT.F16:
        h = x.astype(np.float16)
        h.view(np.uint16)[0, :len(special_f16_bits())] = special_f16_bits()
        w.add_tensor("weight", h)
    elif qtype == QT.BF16:
        b = gguf.quants.quantize(x, QT.BF16)
        b.view(np.uint16)[0, :len(special_bf16_bits())] = special_bf16_bits()
        w.add_tensor("weight", b, raw_dtype=QT.BF16)
    elif qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1):
        w.add_tensor("weight", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    elif qtype == QT.Q4_K:
        w.add_tensor("weight", raw_q4_k(rng, ROWS * COLS // 256).reshape(ROWS, -1), raw_dtype=qtype)
    elif qtype == QT.Q6_K:
        w.add_tensor("weight", raw_q6_k(rng, ROWS * COLS // 256).reshape(ROWS, -1), raw_dtype=qtype)
    else:
        raise ValueError(qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- synthetic metadata ----------------------------------------------------------------------

def typed(vtype: VT, value, sub: VT | None = None) -> dict:
    entry = {"type": vtype.name.lower(), "value": value}
    if sub is not None:
        entry["element_type"] = sub.name.lower()
    return entry


METADATA = [
    # key, GGUF type, value, array element type
    ("duet.u8", VT.UINT8, 200, None),
    ("duet.i8", VT.INT8, -100, None),
    ("duet.u16", VT.UINT16, 60000, None),
    ("duet.i16", VT.INT16, -30000, None),
    ("duet.u32", VT.UINT32, 4000000000, None),
    ("duet.i32", VT.INT32, -2000000000, None),
    ("duet.f32", VT.FLOAT32, -1.25, None),
    ("duet.bool_true", VT.BOOL, True, None),
    ("duet.bool_false", VT.BOOL, False, None),
    ("duet.string", VT.STRING, "héllo, GGUF ✓", None),
    ("duet.empty_string", VT.STRING, "", None),
    ("duet.u64", VT.UINT64, 18446744073709551615, None),
    ("duet.i64", VT.INT64, -9223372036854775808, None),
    ("duet.f64", VT.FLOAT64, 3.141592653589793, None),
    ("duet.array_u8", VT.ARRAY, [1, 2, 255], VT.UINT8),
    ("duet.array_i32", VT.ARRAY, [-1, 0, 1, 2147483647], VT.INT32),
    ("duet.array_f32", VT.ARRAY, [0.5, -0.25, 1024.0], VT.FLOAT32),
    ("duet.array_f64", VT.ARRAY, [1e-300, -2.5], VT.FLOAT64),
    ("duet.array_bool", VT.ARRAY, [True, False, True], VT.BOOL),
    ("duet.array_string", VT.ARRAY, ["alpha", "", "γάμμα", "with space"], VT.STRING),
    ("duet.array_nested", VT.ARRAY, [[1, 2], [3], [4, 5, 6]], VT.ARRAY),
    ("duet.array_nested_strings", VT.ARRAY, [["a", "b"], ["c"]], VT.ARRAY),
]


def nested_element_type(value) -> str:
    return "int32" if isinstance(value[0][0], int) else "string"


def write_metadata_file(path: Path) -> list[dict]:
    w = gguf.GGUFWriter(str(path), "duet_fixture")
    w.add_custom_alignment(64)
    expected = [
        {"key": "general.architecture", **typed(VT.STRING, "duet_fixture")},
        {"key": "general.alignment", **typed(VT.UINT32, 64)},
    ]
    for key, vtype, value, sub in METADATA:
        if vtype == VT.ARRAY and sub == VT.ARRAY:
            # GGUFWriter picks the inner element types itself: int -> INT32, str -> STRING.
            w.add_key_value(key, value, VT.ARRAY)
            inner = nested_element_type(value)
            expected.append({"key": key, "type": "array", "element_type": "array",
                             "value": [{"type": "array", "element_type": inner, "value": v} for v in value]})
        elif vtype == VT.ARRAY:
            w.add_key_value(key, value, VT.ARRAY, sub_type=sub)
            expected.append({"key": key, **typed(vtype, value, sub)})
        else:
            w.add_key_value(key, value, vtype)
            expected.append({"key": key, **typed(vtype, value)})
    # Two tensors whose sizes are not multiples of the alignment, so padding shows.
    w.add_tensor("first", np.arange(3, dtype=np.float32))
    w.add_tensor("second", np.arange(10, dtype=np.float32).reshape(2, 5) * np.float32(0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def write_qwen2_file(path: Path) -> dict:
    """A tiny qwen2 description: enough keys and tensors for config and tokenizer extraction."""
    hidden, vocab = 16, 12
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("duet tiny qwen2")
    w.add_block_count(2)
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(8192)
    tokens = ["a", "b", "ab", "Ġ", "Ġa", "Ġab", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>", "c", "bc"]
    token_types = [1, 1, 1, 1, 1, 1, 3, 3, 3, 4, 1, 1]
    merges = ["a b", "Ġ a", "Ġa b", "b c"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(8)
    w.add_bos_token_id(6)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    rng = np.random.default_rng(SEED + 1)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    w.add_tensor("output.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.bias", np.zeros(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        "config": {"arch": "qwen2", "name": "duet tiny qwen2", "n_layers": 2, "hidden": hidden, "n_heads": 4,
                   "n_kv_heads": 2, "head_dim": 4, "ffn": 48, "vocab": vocab, "rope_dim": 4,
                   "rope_theta": 1000000.0, "rms_eps": float(np.float32(1e-6)), "context_length": 32768,
                   "tied_embeddings": False, "attn_qkv_bias": True, "rope_freq_factors": False,
                   "rope_scaling": {"type": "yarn", "factor": 4.0, "original_context_length": 8192}},
        "tokenizer": {"vocab": tokens, "merges": [m.split(" ", 1) for m in merges],
                      "added": [{"id": i, "content": tokens[i], "special": t == 3}
                                for i, t in enumerate(token_types) if t in (3, 4)],
                      "bos_id": 6, "eos_id": 8, "add_bos": False, "pre_tokenizer": "qwen2"},
    }


# --- llama.cpp reference ---------------------------------------------------------------------

def render_chat(template: str, prompt: str, bos: str, eos: str) -> str:
    # As transformers and llama-cpp-python render chat templates.
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=[{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, bos_token=bos, eos_token=eos)


def llama_reference(model: Path) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    reader = gguf.GGUFReader(str(model))
    template = reader.fields["tokenizer.chat_template"].contents()

    vocab_model = Llama(model_path=str(model), vocab_only=True, verbose=False)
    tok = vocab_model.tokenizer_
    vocab = {
        "n_vocab": vocab_model.n_vocab(),
        "bos_id": vocab_model.token_bos(),
        "eos_id": vocab_model.token_eos(),
        "eot_id": llama_cpp.llama_vocab_eot(vocab_model._model.vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab_model._model.vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab_model._model.vocab)),
    }
    corpus = []
    for text in TEXT_CORPUS:
        ids = tok.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        back = vocab_model.detokenize(ids).decode("utf-8", errors="replace")
        corpus.append({"text": text, "ids": ids, "detokenized_equal": back == text})
    del vocab_model

    llm = Llama(model_path=str(model), n_ctx=512, n_batch=512, n_threads=1, n_threads_batch=1,
                seed=LLAMA_SEED, logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()
    bos_text = llm.detokenize([llm.token_bos()], special=True).decode()
    eos_text = llm.detokenize([llm.token_eos()], special=True).decode()

    def last_logits() -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32).copy()

    chats = []
    for prompt in CHAT_PROMPTS:
        rendered = render_chat(template, prompt, bos_text, eos_text)
        ids = llm.tokenize(rendered.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        logits = last_logits()
        order = np.argsort(-logits, kind="stable")[:TOP_K]
        top = {"ids": [int(i) for i in order], "values": [float(logits[i]) for i in order]}
        l2 = float(np.sqrt(np.sum(logits.astype(np.float64) ** 2)))

        greedy = []
        current = logits
        for _ in range(N_GREEDY):
            nxt = int(np.argmax(current))  # first index of the maximum
            greedy.append(nxt)
            llm.eval([nxt])
            current = last_logits()
        # Cross-check against llama.cpp's own greedy sampler (temperature 0).
        llm.reset()
        sampled = []
        for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            sampled.append(int(t))
            if len(sampled) == N_GREEDY:
                break
        eos_ids = {llm.token_eos(), vocab["eot_id"]}
        first_eos = next((i for i, t in enumerate(greedy) if t in eos_ids), None)
        chats.append({
            "prompt": prompt,
            "rendered": rendered,
            "prompt_ids": ids,
            "last_logits_top": top,
            "last_logits_l2": l2,
            "last_logits_argmax": int(np.argmax(logits)),
            "greedy_ids": greedy,
            "greedy_text": llm.detokenize(greedy, special=True).decode("utf-8", errors="replace"),
            "greedy_first_eos_index": first_eos,
            "llama_sampler_greedy_agrees": sampled == greedy,
        })
    return {
        "vocab": vocab,
        "text_corpus": corpus,
        "chat": chats,
        "settings": {"n_ctx": 512, "n_batch": 512, "n_threads": 1, "seed": LLAMA_SEED, "temperature": 0.0,
                     "tokenize_corpus": {"add_bos": False, "special": False},
                     "tokenize_chat": {"add_bos": False, "special": True},
                     "chat_template_render": "jinja2 ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks), "
                                             "messages=[user], add_generation_prompt=True"},
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


# --- main ------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict:
    from importlib.metadata import version
    v = {"python": platform.python_version(), "numpy": np.__version__, "gguf": version("gguf")}
    try:
        v["llama_cpp_python"] = version("llama_cpp_python")
        v["llama_cpp_commit"] = "4227c9be4268ac844921b90f31595f81236bd317 (vendored by llama-cpp-python 0.3.16)"
    except Exception:  # noqa: BLE001 - llama-cpp-python is optional with --skip-llama
        pass
    return v


def write_json(path: Path, data: dict) -> None:
    text = json.dumps(data, indent=1, ensure_ascii=False)
    # Lists of plain numbers (bit patterns, token ids, logits) on one line each.
    text = re.sub(r"\[\s*(-?[0-9][-0-9.eE+]*(?:,\s*-?[0-9][-0-9.eE+]*)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    path.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the SmolLM2 Q4_1 GGUF")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--skip-llama", action="store_true", help="do not regenerate llama_cpp_reference.json")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.model.is_file():
        print(f"{args.model} is missing: run scripts/fetch-model.sh first", file=sys.stderr)
        return 1

    rng = np.random.default_rng(SEED)
    entries = []
    for qtype in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K):
        path = out / f"synth_{qtype.name.lower()}.gguf"
        write_single_tensor_file(path, qtype, rng)
        reader = gguf.GGUFReader(str(path))
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        span = max(block, 32)
        entries.append(tensor_entry(path.name, reader, "weight", [0, span, 2 * COLS, -1], span))
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")

    model_label = "models/" + args.model.name
    reader = gguf.GGUFReader(str(args.model))
    present = sorted({t.tensor_type.name for t in reader.tensors})
    for name, starts, span in [
        ("token_embd.weight", [0, 576 * 1000, 576 * 49151, -1], 64),  # Q8_0
        ("blk.0.ffn_down.weight", [0, 1536 * 300, -1], 64),            # Q4_1
        ("blk.29.attn_v.weight", [0, -1], 32),                         # Q4_1
        ("blk.0.attn_norm.weight", [0, 544], 32),                      # F32
        ("output_norm.weight", [0], 32),                               # F32
    ]:
        entries.append(tensor_entry(model_label, reader, name, starts, span))
    write_json(out / "dequant_reference.json", {
        "generator": "tests/tools/make_gguf_fixtures.py",
        "versions": versions(),
        "model": {"file": model_label, "sha256": sha256(args.model), "tensor_types": present},
        "checksum": "weighted_sum = sum_i bits[i] * (2 i + 1) mod 2^64, bits[i] = float32 bits of element i",
        "tensors": entries,
    })

    metadata = write_metadata_file(out / "synth_metadata.gguf")
    print(f"wrote tests/data/gguf/synth_metadata.gguf")
    qwen2 = write_qwen2_file(out / "synth_qwen2.gguf")
    print(f"wrote tests/data/gguf/synth_qwen2.gguf")
    write_json(out / "metadata_reference.json", {
        "generator": "tests/tools/make_gguf_fixtures.py",
        "versions": versions(),
        "synth_metadata.gguf": {"alignment": 64, "metadata": metadata,
                                "tensors": [{"name": "first", "shape": [3], "offset": 0},
                                            {"name": "second", "shape": [5, 2], "offset": 64}]},
        "synth_qwen2.gguf": qwen2,
    })

    if not args.skip_llama:
        ref = llama_reference(args.model)
        write_json(out / "llama_cpp_reference.json", {
            "generator": "tests/tools/make_gguf_fixtures.py",
            "versions": versions(),
            "model": {"file": model_label, "sha256": sha256(args.model)},
            **ref,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
