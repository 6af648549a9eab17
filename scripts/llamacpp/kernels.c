/*
 * inferd-kernels: runs llama.cpp's CPU matrix kernels (through ggml-cpu.h)
 * on given weight rows and activations, for the kernel-agreement vectors of
 * tests/vectors/kernels_llamacpp.txt. Compiled and driven by
 * scripts/golden-kernels.
 *
 *   stdin, one case a line: "TYPE_ID N ROWS TOKENS W_HEX X_HEX"
 *     W_HEX: ROWS weight rows of N elements of ggml type TYPE_ID (raw bytes);
 *     X_HEX: TOKENS activation rows of N f32 values (little-endian bits).
 *   stdout, one line each: "Q_HEX VEC_DOT MUL_MAT"
 *     Q_HEX: the activations quantized by the weight type's vec_dot_type
 *            `from_float` (llama.cpp's activation quantizer), all tokens;
 *     VEC_DOT: ROWS x TOKENS results (row-major) of the one-pair `vec_dot`
 *            kernel, as f32 bits (8 hex digits each);
 *     MUL_MAT: the same results from ggml_mul_mat over all TOKENS at once
 *            (llama.cpp's batched path, tinyBLAS where it applies), one
 *            thread, from a plain context (no weight repacking).
 */
#include "ggml-cpu.h"
#include "ggml.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LINE (1 << 22)

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Decodes `len` bytes of hex at `s` into `out`; returns 0 on bad input. */
static int unhex(const char *s, size_t len, uint8_t *out) {
    for (size_t i = 0; i < len; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0) return 0;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return 1;
}

static void put_hex(const uint8_t *b, size_t len) {
    for (size_t i = 0; i < len; i++) printf("%02x", b[i]);
}

static void put_f32_bits(const float *v, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        printf("%08x", u);
    }
}

int main(void) {
    ggml_cpu_init();
    char *line = malloc(MAX_LINE);
    if (!line) return 1;
    while (fgets(line, MAX_LINE, stdin)) {
        int id, n, rows, tokens, w_at, x_at;
        if (sscanf(line, "%d %d %d %d %n%*s %n", &id, &n, &rows, &tokens, &w_at, &x_at) != 4) {
            fprintf(stderr, "inferd-kernels: bad line\n");
            return 1;
        }
        const enum ggml_type wt = (enum ggml_type)id;
        const struct ggml_type_traits_cpu *wtr = ggml_get_type_traits_cpu(wt);
        const enum ggml_type at = wtr->vec_dot_type;
        const struct ggml_type_traits_cpu *atr = ggml_get_type_traits_cpu(at);
        const size_t w_row = ggml_row_size(wt, n), a_row = ggml_row_size(at, n);
        const size_t w_len = w_row * rows, x_len = sizeof(float) * n * tokens;

        struct ggml_init_params params = {w_len + x_len + 4 * sizeof(float) * rows * tokens +
                                              64 * ggml_tensor_overhead() + ggml_graph_overhead() +
                                              (1 << 20),
                                          NULL, false};
        struct ggml_context *ctx = ggml_init(params);
        struct ggml_tensor *w = ggml_new_tensor_2d(ctx, wt, n, rows);
        struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, tokens);
        if (!unhex(line + w_at, w_len, w->data) || !unhex(line + x_at, x_len, x->data)) {
            fprintf(stderr, "inferd-kernels: bad hex\n");
            return 1;
        }

        uint8_t *q = malloc(a_row * tokens);
        float *dots = malloc(sizeof(float) * rows * tokens);
        for (int t = 0; t < tokens; t++) {
            atr->from_float((const float *)x->data + (size_t)t * n, q + t * a_row, n);
        }
        for (int r = 0; r < rows; r++) {
            for (int t = 0; t < tokens; t++) {
                wtr->vec_dot(n, &dots[r * tokens + t], 0, (const uint8_t *)w->data + r * w_row, 0,
                             q + t * a_row, 0, 1);
            }
        }

        struct ggml_tensor *y = ggml_mul_mat(ctx, w, x);
        struct ggml_cgraph *graph = ggml_new_graph(ctx);
        ggml_build_forward_expand(graph, y);
        if (ggml_graph_compute_with_ctx(ctx, graph, 1) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "inferd-kernels: graph failed\n");
            return 1;
        }
        /* y is [tokens][rows]; print row-major [rows][tokens] like VEC_DOT. */
        float *mm = malloc(sizeof(float) * rows * tokens);
        for (int r = 0; r < rows; r++) {
            for (int t = 0; t < tokens; t++) mm[r * tokens + t] = ((const float *)y->data)[t * rows + r];
        }

        put_hex(q, a_row * tokens);
        putchar(' ');
        put_f32_bits(dots, (size_t)rows * tokens);
        putchar(' ');
        put_f32_bits(mm, (size_t)rows * tokens);
        putchar('\n');
        free(q);
        free(dots);
        free(mm);
        ggml_free(ctx);
    }
    free(line);
    return 0;
}
