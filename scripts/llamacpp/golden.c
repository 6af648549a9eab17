/*
 * inferd-golden: dumps reference values from llama.cpp (through llama.h) for
 * inferd's golden-vector tests. Built by scripts/build-llamacpp against the
 * libllama it builds; driven by scripts/golden-llamacpp, scripts/golden-models
 * and (to quantize) scripts/make-models.
 *
 *   inferd-golden tokenize MODEL
 *     stdin, one request a line: "<parse_special 0|1> <text as hex bytes>"
 *     stdout, one line each: the token ids, space-separated (no BOS added).
 *
 *   inferd-golden vocab MODEL
 *     stdout, one JSON object: vocabulary size, BOS/EOS/EOT ids, whether BOS
 *     is added, and the ids llama.cpp treats as end-of-generation and control.
 *
 *   inferd-golden greedy MODEL THREADS N_PREDICT TOP_K
 *     stdin, one prompt a line: token ids, space-separated.
 *     stdout, one JSON object a line: the TOP_K (id, logprob) pairs at the
 *     last prompt position (log-softmax of the raw logits, in double), then
 *     N_PREDICT greedy tokens (argmax of the raw logits, lowest id on ties,
 *     never stopping at end-of-generation) with each one's logprob, then
 *     the same continuation with every step computed by a fresh prefill of
 *     the whole sequence. For both paths, each step's margin: the largest
 *     logit minus the second largest (how decisive the greedy choice was);
 *     and, at each step where both paths have seen the same tokens, the
 *     largest absolute difference between their logits (llama.cpp's own
 *     arithmetic noise from one summation order to another), else null;
 *     and the batched path's TOP_K (id, logprob) pairs at every step.
 *     Every prompt gets a fresh context: flash attention off, f16 KV cache,
 *     one batch for the whole prompt.
 *
 * Every model runs on llama.cpp's plain CPU path: no repacked weight
 * buffers (use_extra_bufts off) and no tiled K-quant matrix multiply
 * (GGML_CPU_TILED_MM=0). Those paths sum in other orders than ggml's
 * vec_dot kernels, and on Gemma the two disagree with each other by about
 * 0.2 nats; inferd's kernels give vec_dot's bits, so the reference is the
 * path those bits can be compared with.
 *
 *   inferd-golden quantize IN OUT TYPE THREADS
 *     llama_model_quantize(IN, OUT) to TYPE (Q4_K_M, Q5_K_M, Q6_K, Q8_0,
 *     Q4_0, IQ4_XS, IQ4_NL) with llama.cpp's default parameters: what
 *     `llama-quantize IN OUT TYPE THREADS` does (it is a command line around
 *     this one call), without building llama.cpp's common library.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */

#include "llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LINE (1 << 20)
#define MAX_TOKENS 65536

static void quiet_log(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static struct llama_model *load(const char *path, int vocab_only) {
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = vocab_only;
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = false;
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "inferd-golden: cannot load %s\n", path);
        exit(1);
    }
    return model;
}

static int run_tokenize(const char *model_path) {
    struct llama_model *model = load(model_path, 1);
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    char *line = malloc(MAX_LINE);
    char *text = malloc(MAX_LINE / 2 + 1);
    llama_token *ids = malloc(sizeof(llama_token) * MAX_TOKENS);
    if (!line || !text || !ids) return 1;
    while (fgets(line, MAX_LINE, stdin)) {
        size_t len = strcspn(line, "\r\n");
        line[len] = 0;
        if (len < 2 || (line[0] != '0' && line[0] != '1') || line[1] != ' ') {
            fprintf(stderr, "inferd-golden: bad tokenize request line\n");
            return 1;
        }
        int parse_special = line[0] == '1';
        const char *hex = line + 2;
        size_t hex_len = len - 2, n = 0;
        if (hex_len % 2) { fprintf(stderr, "inferd-golden: odd hex length\n"); return 1; }
        for (size_t i = 0; i < hex_len; i += 2) {
            int hi = hexval(hex[i]), lo = hexval(hex[i + 1]);
            if (hi < 0 || lo < 0) { fprintf(stderr, "inferd-golden: bad hex\n"); return 1; }
            text[n++] = (char)(hi * 16 + lo);
        }
        int count = llama_tokenize(vocab, text, (int32_t)n, ids, MAX_TOKENS, false, parse_special);
        if (count < 0) { fprintf(stderr, "inferd-golden: too many tokens\n"); return 1; }
        for (int i = 0; i < count; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        fflush(stdout);
    }
    free(line); free(text); free(ids);
    llama_model_free(model);
    return 0;
}

static int run_vocab(const char *model_path) {
    struct llama_model *model = load(model_path, 1);
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    printf("{\"n_tokens\":%d,\"bos\":%d,\"eos\":%d,\"eot\":%d,\"add_bos\":%s,\"eog\":[",
           n_vocab, llama_vocab_bos(vocab), llama_vocab_eos(vocab), llama_vocab_eot(vocab),
           llama_vocab_get_add_bos(vocab) ? "true" : "false");
    int first = 1;
    for (int i = 0; i < n_vocab; i++)
        if (llama_vocab_is_eog(vocab, i)) { printf(first ? "%d" : ",%d", i); first = 0; }
    printf("],\"control\":[");
    first = 1;
    for (int i = 0; i < n_vocab; i++)
        if (llama_vocab_is_control(vocab, i)) { printf(first ? "%d" : ",%d", i); first = 0; }
    printf("]}\n");
    llama_model_free(model);
    return 0;
}

/* log-softmax of one logit row, in double; returns the log of the partition sum. */
static double log_partition(const float *logits, int n_vocab) {
    double max = logits[0];
    for (int i = 1; i < n_vocab; i++) if (logits[i] > max) max = logits[i];
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++) sum += exp((double)logits[i] - max);
    return max + log(sum);
}

static int argmax(const float *logits, int n_vocab) {
    int best = 0;
    for (int i = 1; i < n_vocab; i++) if (logits[i] > logits[best]) best = i;
    return best;
}

/* The largest logit minus the second largest. */
static double margin(const float *logits, int n_vocab) {
    int best = argmax(logits, n_vocab);
    double second = -INFINITY;
    for (int i = 0; i < n_vocab; i++)
        if (i != best && logits[i] > second) second = logits[i];
    return (double)logits[best] - second;
}

/* The top_k (id, logprob) pairs of a logit row as a JSON array, largest first. */
static void print_top(const float *logits, int n_vocab, int top_k, double lz, int *taken) {
    printf("[");
    memset(taken, 0, sizeof(int) * (size_t)n_vocab);
    for (int k = 0; k < top_k; k++) {
        int best = -1;
        for (int i = 0; i < n_vocab; i++)
            if (!taken[i] && (best < 0 || logits[i] > logits[best])) best = i;
        taken[best] = 1;
        printf("%s[%d,%.9g]", k ? "," : "", best, (double)logits[best] - lz);
    }
    printf("]");
}

static int run_greedy(const char *model_path, int threads, int n_predict, int top_k) {
    struct llama_model *model = load(model_path, 0);
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    char *line = malloc(MAX_LINE);
    llama_token *prompt = malloc(sizeof(llama_token) * MAX_TOKENS);
    int *taken = calloc((size_t)n_vocab, sizeof(int));
    if (!line || !prompt || !taken) return 1;
    while (fgets(line, MAX_LINE, stdin)) {
        int n_prompt = 0;
        char *p = line, *end;
        for (;;) {
            long v = strtol(p, &end, 10);
            if (end == p) break;
            if (v < 0 || v >= n_vocab || n_prompt >= MAX_TOKENS) { fprintf(stderr, "inferd-golden: bad prompt token %ld\n", v); return 1; }
            prompt[n_prompt++] = (llama_token)v;
            p = end;
        }
        if (n_prompt == 0) { fprintf(stderr, "inferd-golden: empty prompt\n"); return 1; }

        struct llama_context_params cp = llama_context_default_params();
        cp.n_ctx = (uint32_t)(n_prompt + n_predict + 16);
        cp.n_batch = (uint32_t)n_prompt;
        cp.n_ubatch = (uint32_t)n_prompt;
        cp.n_threads = threads;
        cp.n_threads_batch = threads;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        cp.type_k = GGML_TYPE_F16;
        cp.type_v = GGML_TYPE_F16;
        cp.no_perf = true;
        struct llama_context *ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "inferd-golden: cannot create context\n"); return 1; }

        if (llama_decode(ctx, llama_batch_get_one(prompt, n_prompt)) != 0) {
            fprintf(stderr, "inferd-golden: prompt decode failed\n");
            return 1;
        }
        const float *logits = llama_get_logits_ith(ctx, -1);
        double lz = log_partition(logits, n_vocab);

        printf("{\"top\":");
        print_top(logits, n_vocab, top_k, lz, taken);
        printf(",\"generated\":[");

        double lps[4096], margins[4096];
        if (n_predict > 4096) return 1;
        /* Each step's logits, to compare with the batched path's below. */
        float *step_logits = malloc(sizeof(float) * (size_t)n_vocab * (size_t)n_predict);
        llama_token *decoded = malloc(sizeof(llama_token) * (size_t)n_predict);
        if (!step_logits || !decoded) return 1;
        for (int step = 0; step < n_predict; step++) {
            llama_token next = argmax(logits, n_vocab);
            lps[step] = (double)logits[next] - lz;
            margins[step] = margin(logits, n_vocab);
            memcpy(step_logits + (size_t)step * (size_t)n_vocab, logits, sizeof(float) * (size_t)n_vocab);
            decoded[step] = next;
            printf("%s%d", step ? "," : "", next);
            if (step + 1 == n_predict) break;
            if (llama_decode(ctx, llama_batch_get_one(&next, 1)) != 0) {
                fprintf(stderr, "inferd-golden: decode failed at step %d\n", step);
                return 1;
            }
            logits = llama_get_logits_ith(ctx, -1);
            lz = log_partition(logits, n_vocab);
        }
        printf("],\"generated_logprobs\":[");
        for (int step = 0; step < n_predict; step++) printf("%s%.9g", step ? "," : "", lps[step]);
        printf("],\"margins\":[");
        for (int step = 0; step < n_predict; step++) printf("%s%.9g", step ? "," : "", margins[step]);
        llama_free(ctx);

        /* The same greedy continuation with every step computed by a fresh
           prefill of the whole sequence in one batch. llama.cpp's one-token
           decode orders the attention sums differently from its batched
           path, so the two can pick different tokens at near-ties; a
           batch-invariant engine can match only one of them. */
        printf("],\"generated_by_prefill\":[");
        llama_token *seq = malloc(sizeof(llama_token) * (size_t)(n_prompt + n_predict));
        if (!seq) return 1;
        memcpy(seq, prompt, sizeof(llama_token) * (size_t)n_prompt);
        double prefill_margins[4096], path_diff[4096];
        float *prefill_logits = malloc(sizeof(float) * (size_t)n_vocab * (size_t)n_predict);
        if (!prefill_logits) return 1;
        int same_tokens = 1; /* both paths have seen the same tokens so far */
        for (int step = 0; step < n_predict; step++) {
            const int n = n_prompt + step;
            struct llama_context_params fp = cp;
            fp.n_batch = (uint32_t)n;
            fp.n_ubatch = (uint32_t)n;
            struct llama_context *fctx = llama_init_from_model(model, fp);
            if (!fctx) { fprintf(stderr, "inferd-golden: cannot create context\n"); return 1; }
            if (llama_decode(fctx, llama_batch_get_one(seq, n)) != 0) {
                fprintf(stderr, "inferd-golden: prefill failed at step %d\n", step);
                return 1;
            }
            const float *fl = llama_get_logits_ith(fctx, -1);
            seq[n] = argmax(fl, n_vocab);
            memcpy(prefill_logits + (size_t)step * (size_t)n_vocab, fl, sizeof(float) * (size_t)n_vocab);
            prefill_margins[step] = margin(fl, n_vocab);
            path_diff[step] = -1.0;
            if (same_tokens) {
                const float *il = step_logits + (size_t)step * (size_t)n_vocab;
                double worst = 0.0;
                for (int i = 0; i < n_vocab; i++) {
                    double d = fabs((double)fl[i] - (double)il[i]);
                    if (d > worst) worst = d;
                }
                path_diff[step] = worst;
                same_tokens = seq[n] == decoded[step];
            }
            printf("%s%d", step ? "," : "", seq[n]);
            llama_free(fctx);
        }
        printf("],\"margins_by_prefill\":[");
        for (int step = 0; step < n_predict; step++) printf("%s%.9g", step ? "," : "", prefill_margins[step]);
        printf("],\"path_logit_diff\":[");
        for (int step = 0; step < n_predict; step++) {
            if (path_diff[step] < 0) printf("%snull", step ? "," : "");
            else printf("%s%.9g", step ? "," : "", path_diff[step]);
        }
        printf("],\"top_by_prefill\":[");
        for (int step = 0; step < n_predict; step++) {
            const float *fl = prefill_logits + (size_t)step * (size_t)n_vocab;
            if (step) printf(",");
            print_top(fl, n_vocab, top_k, log_partition(fl, n_vocab), taken);
        }
        free(seq);
        free(prefill_logits);
        free(step_logits);
        free(decoded);
        printf("]}\n");
        fflush(stdout);
    }
    free(line); free(prompt); free(taken);
    llama_model_free(model);
    return 0;
}

static int run_quantize(const char *in, const char *out, const char *type, int threads) {
    static const struct { const char *name; enum llama_ftype ftype; } types[] = {
        {"Q4_0", LLAMA_FTYPE_MOSTLY_Q4_0},     {"Q8_0", LLAMA_FTYPE_MOSTLY_Q8_0},
        {"Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M}, {"Q5_K_M", LLAMA_FTYPE_MOSTLY_Q5_K_M},
        {"Q6_K", LLAMA_FTYPE_MOSTLY_Q6_K},     {"IQ4_NL", LLAMA_FTYPE_MOSTLY_IQ4_NL},
        {"IQ4_XS", LLAMA_FTYPE_MOSTLY_IQ4_XS},
    };
    struct llama_model_quantize_params params = llama_model_quantize_default_params();
    int found = 0;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (strcmp(types[i].name, type) == 0) { params.ftype = types[i].ftype; found = 1; }
    if (!found) { fprintf(stderr, "inferd-golden: unknown quantization type %s\n", type); return 2; }
    params.nthread = threads;
    if (llama_model_quantize(in, out, &params) != 0) {
        fprintf(stderr, "inferd-golden: quantizing %s failed\n", in);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    /* Read once by ggml-cpu on the first matrix multiply, so set before any. */
    setenv("GGML_CPU_TILED_MM", "0", 1);
    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    int rc;
    if (argc == 3 && strcmp(argv[1], "tokenize") == 0) {
        rc = run_tokenize(argv[2]);
    } else if (argc == 3 && strcmp(argv[1], "vocab") == 0) {
        rc = run_vocab(argv[2]);
    } else if (argc == 6 && strcmp(argv[1], "greedy") == 0) {
        rc = run_greedy(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
    } else if (argc == 6 && strcmp(argv[1], "quantize") == 0) {
        rc = run_quantize(argv[2], argv[3], argv[4], atoi(argv[5]));
    } else if (argc == 2 && strcmp(argv[1], "info") == 0) {
        printf("%s\n", llama_print_system_info());
        rc = 0;
    } else {
        fprintf(stderr, "usage: inferd-golden tokenize MODEL | vocab MODEL | greedy MODEL THREADS N_PREDICT TOP_K |\n"
                        "       quantize IN OUT TYPE THREADS | info\n");
        rc = 2;
    }
    llama_backend_free();
    return rc;
}
