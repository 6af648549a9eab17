/*
 * inferd-golden: dumps reference values from llama.cpp (through llama.h) for
 * inferd's golden-vector tests. Built by scripts/build-llamacpp against the
 * libllama it builds; driven by scripts/golden-llamacpp.
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
 *     never stopping at end-of-generation) with each one's logprob.
 *     Every prompt gets a fresh context: flash attention off, f16 KV cache,
 *     one batch for the whole prompt.
 */
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

        printf("{\"top\":[");
        memset(taken, 0, sizeof(int) * (size_t)n_vocab);
        for (int k = 0; k < top_k; k++) {
            int best = -1;
            for (int i = 0; i < n_vocab; i++)
                if (!taken[i] && (best < 0 || logits[i] > logits[best])) best = i;
            taken[best] = 1;
            printf("%s[%d,%.9g]", k ? "," : "", best, (double)logits[best] - lz);
        }
        printf("],\"generated\":[");

        double lps[4096];
        if (n_predict > 4096) return 1;
        for (int step = 0; step < n_predict; step++) {
            llama_token next = argmax(logits, n_vocab);
            lps[step] = (double)logits[next] - lz;
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
            seq[n] = argmax(llama_get_logits_ith(fctx, -1), n_vocab);
            printf("%s%d", step ? "," : "", seq[n]);
            llama_free(fctx);
        }
        free(seq);
        printf("]}\n");
        fflush(stdout);
    }
    free(line); free(prompt); free(taken);
    llama_model_free(model);
    return 0;
}

int main(int argc, char **argv) {
    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    int rc;
    if (argc == 3 && strcmp(argv[1], "tokenize") == 0) {
        rc = run_tokenize(argv[2]);
    } else if (argc == 3 && strcmp(argv[1], "vocab") == 0) {
        rc = run_vocab(argv[2]);
    } else if (argc == 6 && strcmp(argv[1], "greedy") == 0) {
        rc = run_greedy(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
    } else if (argc == 2 && strcmp(argv[1], "info") == 0) {
        printf("%s\n", llama_print_system_info());
        rc = 0;
    } else {
        fprintf(stderr, "usage: inferd-golden tokenize MODEL | vocab MODEL | greedy MODEL THREADS N_PREDICT TOP_K | info\n");
        rc = 2;
    }
    llama_backend_free();
    return rc;
}
