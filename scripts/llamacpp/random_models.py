"""Models of real shape with random weights: what scripts/make-models builds
and scripts/golden-models and tests/llamacpp_models.rs check.

Each model has the hyper-parameters, tensors and metadata that
convert_hf_to_gguf.py writes for the real checkpoint (its config.json as
published), the real tokenizer (copied from llama.cpp's vocabulary-only GGUF
of that family, scripts/fetch-vocabs), and weights drawn from a fixed seed:
the same bytes on every run. The F16 file is then quantized by llama.cpp's
own quantizer (llama_model_quantize, what llama-quantize runs) to each type
users download.

Why the weights look the way they do: greedy decoding compares the two
largest logits, and two engines that add in a different order (or round an
activation to 8 bits on the other side of a boundary) disagree when those
are nearly equal. Logits drawn at random (any random network's) have such
near-ties at a steady rate however they are scaled, so these models are
built for a margin by construction:

- The output matrix is the token embedding matrix (tied, as in Llama 3.2,
  Qwen2.5 and Qwen3), or for untied models (Mistral) its rows in a fixed
  random order. The logit of the token whose output row is the current
  token's embedding then gets |e|^2 / rms(x), far above the others' random
  values (standard deviation LOGIT_STD): the greedy choice is decisive.
  With tied embeddings that token is the current one (the continuation
  repeats it); with the permuted rows it is the next one of a fixed random
  chain of tokens.
- The layers still decide everything else: their output projections are
  scaled by OUT_GAIN so they move the residual stream by about three times
  the embedding's size, enough that every other logit (the top-10 the tests
  compare, at every step) depends on every tensor of every layer, yet small
  enough that the current token's embedding keeps its lead.
- Attention scores have a standard deviation of about ATTN_QK_GAIN**2 and
  norm weights are close to 1, so no head is one-hot and no layer is off.
- LOGIT_STD is small (0.5) because the logits' noise is proportional to
  it: 8-bit activations turn the last-bit differences of another summation
  order into whole quantization steps, and on K-quant files llama.cpp's
  own incremental and batched paths differ by about 0.1 * LOGIT_STD at the
  largest logit of the vocabulary (0.3 with LOGIT_STD = 3, 0.04 with 0.5),
  which the 0.05 tolerance on log-probabilities has to absorb. The margins
  come from the embedding's lead, LOGIT_STD**2 / rms(x), which the small
  OUT_GAIN keeps large (about 6 here, scripts/golden-models reports them).

scripts/golden-models reports each file's smallest top-1 minus top-2 margin
along the continuations, next to llama.cpp's own logit noise between its
incremental and batched paths.
"""
import hashlib
import math
import os

# Bump when the weights or metadata written change: the recipe of every file
# changes with it, so scripts/make-models rebuilds them.
GENERATOR_VERSION = 4
SEED = 20261201
LOGIT_STD = 0.5
OUT_GAIN = 0.025
NORM_STD = 0.1
ATTN_QK_GAIN = 1.0
BIAS_STD = 0.5

# The types users download, as llama-quantize names them.
QUANTS = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS", "IQ4_NL"]
# Bits per weight, roughly, to check the disk has room before writing.
BITS_PER_WEIGHT = {"F16": 16.0, "Q4_K_M": 5.0, "Q5_K_M": 5.8, "Q6_K": 6.6, "Q8_0": 8.5,
                   "Q4_0": 4.8, "IQ4_XS": 4.6, "IQ4_NL": 4.8}

# The real checkpoints' config.json, as convert_hf_to_gguf.py turns them
# into GGUF metadata. `head_dim_key`: the config has head_dim, so the
# converter writes attention.key_length / value_length; `llama_keys`: the
# llama converter also writes vocab_size and rope.dimension_count.
MODELS = {
    "llama-3.2-1b": dict(
        title="Llama-3.2-1B", hf="meta-llama/Llama-3.2-1B", arch="llama", vocab="llama-bpe",
        n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8, head_dim=64,
        n_ctx=131072, rope_theta=500000.0, rms_eps=1e-5, tied=True,
        head_dim_key=True, llama_keys=True, qkv_bias=False, qk_norm=False,
        # rope_scaling {"rope_type": "llama3", ...}: the converter writes no
        # scaling keys but a rope_freqs tensor (generate_extra_tensors).
        llama3_rope=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192),
    ),
    "qwen2.5-0.5b": dict(
        title="Qwen2.5-0.5B", hf="Qwen/Qwen2.5-0.5B", arch="qwen2", vocab="qwen2",
        n_layer=24, n_embd=896, n_ff=4864, n_head=14, n_head_kv=2, head_dim=64,
        n_ctx=32768, rope_theta=1000000.0, rms_eps=1e-6, tied=True,
        head_dim_key=False, llama_keys=False, qkv_bias=True, qk_norm=False, llama3_rope=None,
    ),
    "qwen3-0.6b": dict(
        title="Qwen3-0.6B", hf="Qwen/Qwen3-0.6B", arch="qwen3", vocab="qwen2",
        n_layer=28, n_embd=1024, n_ff=3072, n_head=16, n_head_kv=8, head_dim=128,
        n_ctx=40960, rope_theta=1000000.0, rms_eps=1e-6, tied=True,
        head_dim_key=True, llama_keys=False, qkv_bias=False, qk_norm=True, llama3_rope=None,
    ),
    "mistral-7b-v0.1": dict(
        title="Mistral-7B-v0.1", hf="mistralai/Mistral-7B-v0.1", arch="llama", vocab="llama-spm",
        n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, head_dim=128,
        n_ctx=32768, rope_theta=10000.0, rms_eps=1e-5, tied=False,
        head_dim_key=False, llama_keys=True, qkv_bias=False, qk_norm=False, llama3_rope=None,
    ),
}


def base_name(model, layers):
    """File name stem: the real depth has no layer count in it."""
    spec = MODELS[model]
    return f"{model}-rand" if layers == spec["n_layer"] else f"{model}-rand-{layers}l"


def file_name(model, layers, quant):
    return f"{base_name(model, layers)}-{quant.lower()}.gguf"


def rebuild_command(model, layers, quant):
    return f"scripts/make-models {model} --layers {layers} --types {quant}"


def recipe(model, layers, quant, llamacpp_version):
    """Everything the bytes of a file depend on."""
    return (f"generator {GENERATOR_VERSION} seed {SEED} model {model} layers {layers} "
            f"quant {quant} llama-cpp-python {llamacpp_version}")


def tensor_plan(model, layers):
    """(name, shape as numpy rows x cols, kind, parameter) in file order, as
    the converter orders them. kind: normal (std), norm, bias (std),
    rope_freqs, permuted_embd (token_embd's rows in a fixed random order)."""
    s = MODELS[model]
    d, ff, hd = s["n_embd"], s["n_ff"], s["head_dim"]
    q_dim, kv_dim = s["n_head"] * hd, s["n_head_kv"] * hd
    n_vocab = vocab_size(model)
    emb_std = LOGIT_STD / math.sqrt(d)
    plan = [("token_embd.weight", (n_vocab, d), "normal", emb_std)]
    if s["llama3_rope"]:
        plan.append(("rope_freqs.weight", (hd // 2,), "rope_freqs", None))
    for i in range(layers):
        b = f"blk.{i}."
        plan.append((b + "attn_norm.weight", (d,), "norm", None))
        plan.append((b + "attn_q.weight", (q_dim, d), "normal", ATTN_QK_GAIN / math.sqrt(d)))
        if s["qkv_bias"]:
            plan.append((b + "attn_q.bias", (q_dim,), "bias", BIAS_STD))
        plan.append((b + "attn_k.weight", (kv_dim, d), "normal", ATTN_QK_GAIN / math.sqrt(d)))
        if s["qkv_bias"]:
            plan.append((b + "attn_k.bias", (kv_dim,), "bias", BIAS_STD))
        plan.append((b + "attn_v.weight", (kv_dim, d), "normal", 1.0 / math.sqrt(d)))
        if s["qkv_bias"]:
            plan.append((b + "attn_v.bias", (kv_dim,), "bias", BIAS_STD))
        if s["qk_norm"]:
            plan.append((b + "attn_q_norm.weight", (hd,), "norm", None))
            plan.append((b + "attn_k_norm.weight", (hd,), "norm", None))
        plan.append((b + "attn_output.weight", (d, q_dim), "normal", OUT_GAIN / math.sqrt(q_dim)))
        plan.append((b + "ffn_norm.weight", (d,), "norm", None))
        plan.append((b + "ffn_gate.weight", (ff, d), "normal", 1.0 / math.sqrt(d)))
        plan.append((b + "ffn_up.weight", (ff, d), "normal", 1.0 / math.sqrt(d)))
        plan.append((b + "ffn_down.weight", (d, ff), "normal", OUT_GAIN / math.sqrt(ff)))
    plan.append(("output_norm.weight", (d,), "norm", None))
    if not s["tied"]:
        plan.append(("output.weight", (n_vocab, d), "permuted_embd", emb_std))
    return plan


def tensor_seed(model, name):
    """One generator per tensor, keyed by the model and the tensor's name (not
    the depth): a 2-layer model's tensors equal the real-depth model's first
    two layers."""
    digest = hashlib.sha256(f"{SEED}/{model}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def llama3_rope_factors(head_dim, base, factor, low_freq_factor, high_freq_factor, original_context):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors (rope_type
    llama3), in float32 as it computes them with torch."""
    import numpy as np

    f32 = np.float32
    exponents = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    freqs = f32(1.0) / np.power(f32(base), exponents, dtype=f32)
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_freq_wavelen:
            factors.append(f32(1.0))
        elif wavelen > low_freq_wavelen:
            factors.append(f32(factor))
        else:
            smooth = (f32(original_context) / wavelen - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
            factors.append(f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth))
    return np.array(factors, dtype=f32)


def make_tensor(model, name, shape, kind, param):
    import numpy as np

    s = MODELS[model]
    if kind == "rope_freqs":
        r = s["llama3_rope"]
        return llama3_rope_factors(s["head_dim"], s["rope_theta"], r["factor"], r["low_freq_factor"],
                                   r["high_freq_factor"], r["original_context"])
    rng = np.random.Generator(np.random.PCG64(tensor_seed(model, name)))
    if kind == "permuted_embd":
        embd = make_tensor(model, "token_embd.weight", shape, "normal", param)
        return embd[rng.permutation(shape[0])]
    values = rng.standard_normal(shape, dtype=np.float32)
    if kind == "norm":
        return (values * np.float32(NORM_STD) + np.float32(1.0)).astype(np.float32)
    if kind == "bias":
        return (values * np.float32(param)).astype(np.float32)
    values *= np.float32(param)
    return values.astype(np.float16)  # 2-D weights: F16, as convert_hf_to_gguf.py --outtype f16


def nbytes(shape, kind):
    return math.prod(shape) * (2 if kind in ("normal", "permuted_embd") else 4)


def copy_vocab(gguf, writer, vocab_path):
    """Every tokenizer.* key of the vocabulary file, byte for byte."""
    reader = gguf.GGUFReader(vocab_path)
    n_tokens = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = field.contents()
            writer.add_key_value(key, value, main, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                n_tokens = len(value)
        elif main == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), main)
        else:
            writer.add_key_value(key, field.contents(), main)
    return n_tokens


def write_f16(gguf, model, layers, vocab_path, out_path, log):
    """Writes the F16 model, one tensor at a time (a 7B model never sits in
    memory whole)."""
    import numpy as np

    s = MODELS[model]
    arch = s["arch"]
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_type("model")
    writer.add_name(f"{s['title']} shape, random weights")
    writer.add_description(
        f"Random weights (seed {SEED}, inferd scripts/make-models) at the shapes and metadata "
        f"convert_hf_to_gguf.py gives {s['hf']}; {layers} of its {s['n_layer']} layers.")
    n_vocab = copy_vocab(gguf, writer, vocab_path)
    if n_vocab != vocab_size(model):
        raise SystemExit(f"{vocab_path}: {n_vocab} tokens, expected {vocab_size(model)}")
    writer.add_block_count(layers)
    writer.add_context_length(s["n_ctx"])
    writer.add_embedding_length(s["n_embd"])
    writer.add_feed_forward_length(s["n_ff"])
    writer.add_head_count(s["n_head"])
    writer.add_head_count_kv(s["n_head_kv"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(s["rms_eps"])
    if s["head_dim_key"]:
        writer.add_key_length(s["head_dim"])
        writer.add_value_length(s["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if s["llama_keys"]:
        writer.add_vocab_size(n_vocab)
        writer.add_rope_dimension_count(s["head_dim"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    plan = tensor_plan(model, layers)
    for name, shape, kind, _ in plan:
        dtype = np.float16 if kind in ("normal", "permuted_embd") else np.float32
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes(shape, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, kind, param in plan:
        writer.write_tensor_data(make_tensor(model, name, shape, kind, param))
    writer.close()
    log(f"wrote {out_path} ({len(plan)} tensors, {n_vocab} tokens)")


def param_count(model, layers):
    return sum(math.prod(shape) for _, shape, _, _ in tensor_plan(model, layers))


def vocab_size(model):
    """Tokens in the vocabulary the model uses (the real checkpoints' vocab_size)."""
    return {"llama-bpe": 128256, "qwen2": 151936, "llama-spm": 32000}[MODELS[model]["vocab"]]


def vocab_path(model, vocab_dir):
    return os.path.join(vocab_dir, f"ggml-vocab-{MODELS[model]['vocab']}.gguf")
