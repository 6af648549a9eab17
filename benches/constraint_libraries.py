#!/usr/bin/env python3
"""llguidance (what inferd uses) against outlines-core, on the schema corpus
of tests/interop/schema_corpus.py and Qwen2's 151,936-token vocabulary
(llama.cpp's ggml-vocab-qwen2.gguf, from scripts/fetch-vocabs): schema
coverage, compile time, and mask time per token. Both libraries are Rust
cores behind Python bindings that write the mask into a caller's buffer, so
the two are measured the same way.

Both are set up as inferd sets up llguidance: compact JSON (one space after
`,` and `:`), no free whitespace. A walk per schema takes up to 48 allowed
tokens (seeded random choice; the same seed for both) and times each mask.

Run by scripts/compare-constraint-libraries (which makes the environment).
Usage: constraint_libraries.py VOCAB_GGUF [N_SCHEMAS]
"""

import json
import os
import random
import statistics
import sys
import time

import gguf
import llguidance
import llguidance.numpy
import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "interop"))
from schema_corpus import corpus  # noqa: E402

STEPS = 48
SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def byte_decoder():
    """GPT-2's byte-level BPE alphabet, character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def load_vocab(path):
    reader = gguf.GGUFReader(path)
    field = reader.fields["tokenizer.ggml.tokens"]
    texts = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    types = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    eos_field = reader.fields["tokenizer.ggml.eos_token_id"]
    eos = int(eos_field.parts[eos_field.data[0]][0])
    decode = byte_decoder()
    tokens, special = [], []
    for i, (text, kind) in enumerate(zip(texts, kinds)):
        if kind == 3:  # control
            tokens.append(text.encode())
            special.append(i)
        elif kind == 4:  # user-defined: its text as it is
            tokens.append(text.encode())
        else:
            tokens.append(bytes(decode[c] for c in text))
    return tokens, special, eos


class Wrapped:
    """What llguidance's TokenizerWrapper reads."""

    def __init__(self, tokens, special, eos):
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = None
        single = {t: i for i, t in enumerate(tokens) if len(t) == 1}
        self.by_byte = [single.get(bytes([b]), 0) for b in range(256)]

    def __call__(self, text):
        # Byte by byte: only used for forced strings, not for masks.
        data = text if isinstance(text, bytes) else text.encode()
        return [self.by_byte[b] for b in data]


def allowed_ids(mask, n):
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:n]
    return np.flatnonzero(bits)


def run_llguidance(tokenizer, schema, seed, n):
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults=SEPARATORS)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    mask = llguidance.numpy.allocate_token_bitmask(1, n)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask)
    if matcher.is_error():
        return None, matcher.get_error()
    compile_s = time.perf_counter() - t0
    rng, times = random.Random(seed), []
    for _ in range(STEPS):
        t = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t)
        ids = allowed_ids(mask[0], n)
        ids = ids[ids != tokenizer.eos_token]
        if len(ids) == 0 or matcher.is_stopped():
            break
        matcher.consume_token(int(rng.choice(ids)))
    return (compile_s, times), None


def run_outlines(vocabulary, schema, seed, n, eos):
    t0 = time.perf_counter()
    try:
        regex = build_regex_from_schema(json.dumps(schema), r" ?")
        guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    except Exception as e:  # noqa: BLE001 - a refusal is what is counted
        return None, f"{type(e).__name__}: {e}"
    mask = np.zeros((n + 31) // 32, dtype=np.int32)
    guide.write_mask_into(mask.ctypes.data, mask.size, 4)
    compile_s = time.perf_counter() - t0
    rng, times = random.Random(seed), []
    for _ in range(STEPS):
        t = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - t)
        ids = allowed_ids(mask, n)
        ids = ids[ids != eos]
        if len(ids) == 0 or guide.is_finished():
            break
        guide.advance(int(rng.choice(ids)))
    return (compile_s, times), None


def summary(name, results, total):
    done = [r for r in results if r is not None]
    compiles = sorted(c for c, _ in done)
    masks = [t for _, ts in done for t in ts]
    print(f"{name}: {len(done)}/{total} schemas compile; compile median "
          f"{statistics.median(compiles) * 1e3:.1f} ms, max {compiles[-1] * 1e3:.0f} ms; "
          f"mask per token mean {statistics.mean(masks) * 1e6:.0f} us, "
          f"p99 {sorted(masks)[int(len(masks) * 0.99)] * 1e6:.0f} us ({len(masks)} masks)")


def main():
    path = sys.argv[1]
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else None
    tokens, special, eos = load_vocab(path)
    n = len(tokens)
    print(f"vocabulary: {n} tokens ({os.path.basename(path)}); llguidance "
          f"{llguidance.__version__ if hasattr(llguidance, '__version__') else ''}")
    t0 = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped(tokens, special, eos)))
    print(f"llguidance tokenizer: {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    by_bytes = {}
    for i, t in enumerate(tokens):
        if i != eos and i not in special:
            by_bytes.setdefault(t, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, by_bytes)
    print(f"outlines-core vocabulary: {time.perf_counter() - t0:.2f} s")
    schemas = corpus()[:limit]
    llg, out = [], []
    for k, schema in enumerate(schemas):
        r, err = run_llguidance(tokenizer, schema, k, n)
        llg.append(r)
        if err:
            print(f"  schema {k}: llguidance refuses: {err[:120]}")
        r, err = run_outlines(vocabulary, schema, k, n, eos)
        out.append(r)
        if err:
            print(f"  schema {k}: outlines-core refuses: {err[:120]}")
        sys.stdout.flush()
    summary("llguidance", llg, len(schemas))
    summary("outlines-core", out, len(schemas))


if __name__ == "__main__":
    main()
