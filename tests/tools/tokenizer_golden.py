#!/usr/bin/env python3
"""Golden token ids from HF's `tokenizers` library, for tests/test_tokenizer.cpp.

For each variant (a tokenizer.json from tests/data/tokenizers/, possibly modified) this writes
OUT/<variant>/tokenizer.json (the exact file HF encoded with, so the C++ side loads the same
one) and OUT/<variant>/golden.jsonl, one JSON object a line:
  {"kind": "encode", "text": ..., "add_special": bool, "ids": [...], "decoded": ...}
  {"kind": "decode", "ids": [...], "skip_special": bool, "decoded": ...}
Texts: the cases of tests/data/tokenizer-corpus.txt (separated by lines holding only "%%"),
cases written below with explicit escapes, and seeded random strings. Deterministic.

With --gguf FILE (a byte-level BPE GGUF, e.g. SmolLM2-135M), also variant "gguf": a
tokenizer.json built from the GGUF's tokenizer.ggml.* keys with the HF pre-tokenizer of its
tokenizer.ggml.pre family, so the C++ side can compare its GGUF path with HF on that vocab.

usage: tokenizer_golden.py --data tests/data --out DIR [--gguf FILE]
"""
import argparse
import copy
import json
import os
import random
import struct
import sys

import tokenizers

# Pre-tokenizer of SmolLM/SmolLM2 (llama.cpp family "smollm"): digits one by one, then GPT-2's.
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}
GPT2_PRE_TOKENIZER = {
    "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True,
}


def with_flagged_added_tokens(tj):
    """Adds tokens exercising lstrip, rstrip, single_word and normalized matching.

    Ids follow HF's own rule, so the file reads as HF would save it: content already in the
    model vocab keeps that id ("foo"), new content gets the next free id.
    """
    vocab = tj["model"]["vocab"]
    next_id = max([a["id"] for a in tj["added_tokens"]] + list(vocab.values())) + 1
    specs = [
        ("<mask>", dict(special=True, lstrip=True)),
        ("[RS]", dict(rstrip=True)),
        ("foo", dict(single_word=True)),
        ("\u00c5ngstr", dict(normalized=True)),
        ("caf\u00e9", dict(normalized=True)),
        ("<both>", dict(special=True, lstrip=True, rstrip=True)),
    ]
    for content, flags in specs:
        if content in vocab:
            id_ = vocab[content]
        else:
            id_, next_id = next_id, next_id + 1
        token = {"id": id_, "content": content, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": False}
        token.update(flags)
        tj["added_tokens"].append(token)
    return tj


def with_pre_tokenizer(pre):
    """Another model family's pre-tokenizer; like SmolLM2 and GPT-2, no normalizer."""
    def apply(tj):
        tj["pre_tokenizer"] = copy.deepcopy(pre)
        tj["normalizer"] = None
        return tj
    return apply


# HF pre-tokenizers of the GGUF families this script can rebuild (llama.cpp's names).
GGUF_PRE_TOKENIZERS = {"smollm": SMOLLM_PRE_TOKENIZER, "gpt2": GPT2_PRE_TOKENIZER,
                       "gpt-2": GPT2_PRE_TOKENIZER}


def read_gguf_metadata(path):
    """The key/value metadata of a GGUF v2/v3 file (tensor data is not read)."""
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
              10: "<Q", 11: "<q", 12: "<d"}
    with open(path, "rb") as f:
        def read(fmt):
            size = struct.calcsize(fmt)
            return struct.unpack(fmt, f.read(size))[0]

        def read_string():
            return f.read(read("<Q")).decode("utf-8", errors="surrogateescape")

        def read_value(kind):
            if kind in scalar:
                return read(scalar[kind])
            if kind == 8:
                return read_string()
            if kind == 9:
                elem, count = read("<I"), read("<Q")
                return [read_value(elem) for _ in range(count)]
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = read("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version}")
        read("<Q")  # tensor count
        metadata = {}
        for _ in range(read("<Q")):
            key = read_string()
            metadata[key] = read_value(read("<I"))
        return metadata


def tokenizer_json_from_gguf(path):
    meta = read_gguf_metadata(path)
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{path}: not a byte-level BPE GGUF")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{path}: no HF pre-tokenizer known for family {pre!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == 3}
             for i, t in enumerate(tokens) if types[i] in (3, 4)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": copy.deepcopy(GGUF_PRE_TOKENIZERS[pre]),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": meta.get("tokenizer.ggml.merges", [])},
    }


# name -> (base tokenizer directory, modification)
VARIANTS = {
    "llama3_1": ("llama3_1", None),
    "qwen3": ("qwen3", None),
    "qwen3_smollm": ("qwen3", with_pre_tokenizer(SMOLLM_PRE_TOKENIZER)),
    "qwen3_gpt2": ("qwen3", with_pre_tokenizer(GPT2_PRE_TOKENIZER)),
    "qwen3_added": ("qwen3", with_flagged_added_tokens),
    "llama3_1_added": ("llama3_1", with_flagged_added_tokens),
}

# Cases whose characters are easier to read as escapes.
ESCAPED_CASES = [
    "windows\r\nline\r\nendings\r\n",
    "\r\n\r\n\r\n",
    "mixed \n\r\n \r \n\n\t\n",
    "e\u0301 (e + combining acute) vs \u00e9 (precomposed)",
    "A\u030a (A + ring) \u212b (angstrom sign) \u2126 (ohm sign) \u00c5",
    "\u1112\u1161\u11ab\u1100\u1173\u11af (decomposed hangul) \ud55c\uae00",
    "\u304b\u3099 \u30cf\u309a (kana + voiced marks)",
    "control \x00 \x01 \x1b[31mred\x1b[0m \x7f end",
    "\ufeffbyte order mark at the start",
    "zero\u200bwidth\u200cnon\u200djoiner",
    "line\u2028separator\u2029paragraph\u0085next line",
    "\U00010000 \U0001d518\U0001d52b\U0001d526 \U0001f600 \U0001f9d1\u200d\U0001f4bb",
    "a" * 300,
    "ab" * 200,
    "\u4e2d" * 120,
    " " * 50 + "x" + "\n" * 20 + "y" + "\t" * 10,
    "<mask> a <mask>b   <mask>",
    "[RS]   after [RS]x [RS]\n\nnext",
    "foo bar foobar barfoo _foo foo_ xfoo foo. (foo) 1foo foo1",
    "A\u030angstr\u00f6m \u00c5ngstr caf\u00e9 cafe\u0301 CAF\u00c9",
    "x   <both>   y<both>z",
    "",
    " ",
    "'s",
    "'S's'll'LL",
]

ATOMS = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" \t\n.,;:!?'\"-_()[]{}<>/\\|@#$%^&*+=~`")
    + ["  ", "   ", "\r\n", "\n\n", "'s", "'S", "'ll", "'ve", "n't",
       "\u00e9", "e\u0301", "\u00df", "\u0130", "\u017f", "\u212a", "\u2126", "\u00c5", "A\u030a",
       "\u4e2d", "\u6587", "\u5b57", "\ud55c", "\u1100\u1161", "\u3042", "\u30a2", "\u3002", "\uff01",
       "\U0001f44d", "\U0001f3fd", "\u200d", "\ufe0f", "\U0001f600", "\U0001f1ef\U0001f1f5",
       "\u0661", "\u0662", "\u0967", "\uff11", "\u00bd", "\u216b", "\u00b2",
       "\u00a0", "\u3000", "\u2003", "\u2028", "\u0085", "\x00", "\x1b", "\x7f",
       "\u0410", "\u0431", "\u03a3", "\u03c3", "\u05d0", "\u0627", "\u0e01", "\u0915\u094d",
       "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|begin_of_text|>", "<think>", "</think>",
       "<|", "|>", "<mask>", "[RS]", "foo", "caf\u00e9", "cafe\u0301", "<both>"]
)


def read_corpus(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    cases, current = [], []
    for line in text.split("\n"):
        if line == "%%":
            cases.append("\n".join(current))
            current = []
        else:
            current.append(line)
    if current and current != [""]:
        cases.append("\n".join(current).rstrip("\n"))
    return cases


def random_cases(rng, count):
    cases = []
    for _ in range(count):
        n = rng.randint(1, 40)
        cases.append("".join(rng.choice(ATOMS) for _ in range(n)))
    return cases


def random_id_lists(rng, tok, count):
    size = tok.get_vocab_size(with_added_tokens=True)
    # Single-byte tokens make partial UTF-8 sequences, which decode must replace correctly.
    byte_chars = [chr(c) for c in list(range(0x21, 0x7f)) + list(range(0xa1, 0x144)) if c != 0xad]
    byte_ids = [i for i in (tok.token_to_id(c) for c in byte_chars) if i is not None]
    lists = []
    for _ in range(count):
        n = rng.randint(1, 10)
        ids = []
        for _ in range(n):
            r = rng.random()
            if r < 0.5:
                ids.append(rng.choice(byte_ids))
            elif r < 0.9:
                ids.append(rng.randrange(size))
            else:
                ids.append(rng.randrange(size - 300, size))
        lists.append(ids)
    return lists


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="tests/data")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--gguf", help="a byte-level BPE GGUF to rebuild as variant 'gguf'")
    args = parser.parse_args()

    texts = read_corpus(os.path.join(args.data, "tokenizer-corpus.txt")) + ESCAPED_CASES
    rng = random.Random(20241129)
    texts += random_cases(rng, 400)

    variants = dict(VARIANTS)
    if args.gguf:
        variants["gguf"] = (None, None)
    for name, (base, modify) in variants.items():
        if name == "gguf":
            tj = tokenizer_json_from_gguf(args.gguf)
        else:
            with open(os.path.join(args.data, "tokenizers", base, "tokenizer.json"),
                      encoding="utf-8") as f:
                tj = json.load(f)
        if modify is not None:
            tj = modify(tj)
        out_dir = os.path.join(args.out, name)
        os.makedirs(out_dir, exist_ok=True)
        tj_text = json.dumps(tj, ensure_ascii=False)
        with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tj_text)
        tok = tokenizers.Tokenizer.from_str(tj_text)

        records = []
        for i, text in enumerate(texts):
            for add_special in ([False, True] if i % 10 == 0 else [False]):
                ids = tok.encode(text, add_special_tokens=add_special).ids
                records.append({"kind": "encode", "text": text, "add_special": add_special,
                                "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
        for ids in random_id_lists(random.Random(7), tok, 300):
            for skip in (False, True):
                records.append({"kind": "decode", "ids": ids, "skip_special": skip,
                                "decoded": tok.decode(ids, skip_special_tokens=skip)})
        with open(os.path.join(out_dir, "golden.jsonl"), "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out, "VERSION"), "w", encoding="utf-8") as f:
        f.write(tokenizers.__version__ + "\n")
    print(f"tokenizer_golden: tokenizers {tokenizers.__version__}, {len(variants)} variants, "
          f"{len(texts)} texts", file=sys.stderr)


if __name__ == "__main__":
    main()
