// Reference blocks for vOOM's GGUF dequantizers (formats/src/gguf/dequant.rs),
// computed by ggml itself: each case is one block's bytes and the f32 values that
// ggml's own `to_float` (ggml-quants.c's dequantize_row_*) gives for them.
//
// Build against a llama.cpp tree that has been built (nothing of it is in this
// repository), and write the fixture:
//
//   L=path/to/llama.cpp
//   cc -O2 -I$L/ggml/include tests/conformance/ggml_dequant_blocks.c -L$L/build/bin
//     -lggml-base -Wl,-rpath,$L/build/bin -lm -o /tmp/ggml_dequant_blocks   (one line)
//   /tmp/ggml_dequant_blocks > tests/fixtures/gguf/dequant_blocks.json
//
// Per type: blocks that ggml quantized from random data (normal, tiny values whose
// f16 scales are subnormal, wide ranges, all zeros) and blocks of random bytes
// (any scale bits but infinities and NaNs, which give non-finite values).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"

static uint64_t state = 0x9e3779b97f4a7c15ull;

static uint32_t next_u32(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 16);
}

static float normal(void) {
    double u1 = (next_u32() + 1.0) / 4294967297.0, u2 = next_u32() / 4294967296.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static int first = 1;

static void emit(const char * ty, const char * name, const uint8_t * b, size_t nb,
                 const float * y, int64_t n) {
    printf("%s\n    {\"type\": \"%s\", \"case\": \"%s\", \"bytes_hex\": \"", first ? "" : ",", ty, name);
    first = 0;
    for (size_t i = 0; i < nb; i++) printf("%02x", b[i]);
    printf("\", \"f32_bits\": [");
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &y[i], 4);
        printf("%s%u", i ? ", " : "", bits);
    }
    printf("]}");
}

int main(void) {
    const enum ggml_type types[] = {
        GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0,
        GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K,
        GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS, GGML_TYPE_MXFP4,
    };
    const char * names[] = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                            "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"};
    printf("{\"generator\": \"tests/conformance/ggml_dequant_blocks.c (ggml's to_float)\", \"cases\": [");
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        const enum ggml_type ty = types[t];
        const int64_t n = ggml_blck_size(ty);
        const size_t nb = ggml_type_size(ty);
        const struct ggml_type_traits * tr = ggml_get_type_traits(ty);
        float * x = malloc(n * sizeof(float)), * y = malloc(n * sizeof(float));
        uint8_t * b = malloc(nb);
        // Quantized by ggml from data of several kinds.
        const char * kinds[] = {"normal", "tiny", "wide", "zeros", "positive"};
        for (int k = 0; k < 5; k++) {
            for (int64_t i = 0; i < n; i++) {
                float v = normal();
                switch (k) {
                    case 1: v *= 1e-6f; break;
                    case 2: v *= powf(2.0f, (float)(next_u32() % 24) - 12.0f); break;
                    case 3: v = 0.0f; break;
                    case 4: v = fabsf(v) + 0.5f; break;
                    default: break;
                }
                x[i] = v;
            }
            ggml_quantize_chunk(ty, x, b, 0, 1, n, NULL);
            tr->to_float(b, y, n);
            emit(names[t], kinds[k], b, nb, y, n);
        }
        // Random bytes (rerolled while any value is not finite).
        for (int k = 0; k < 4; k++) {
            int ok = 0;
            while (!ok) {
                for (size_t i = 0; i < nb; i++) b[i] = (uint8_t)next_u32();
                tr->to_float(b, y, n);
                ok = 1;
                for (int64_t i = 0; i < n; i++) ok &= isfinite(y[i]) != 0;
            }
            char name[32];
            snprintf(name, sizeof name, "random bytes %d", k);
            emit(names[t], name, b, nb, y, n);
        }
        free(x);
        free(y);
        free(b);
    }
    printf("\n]}\n");
    return 0;
}
