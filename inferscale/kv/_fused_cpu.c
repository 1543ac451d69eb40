/* Fused KV injection for vLLM's CPU paged cache: rotate stored pre-RoPE keys to their serving
   positions (Chunked RoPE, scaled where the plan asks), and write K and V into the cache's
   blocks in one pass over the memory. Bit-exact with vLLM's rotary kernel on a bf16 table
   followed by vLLM's cache update, on any CPU: the product of two bf16 values is exact in fp32,
   so each output has one rounding (the fp32 sum) whether a build fuses multiply-adds or not
   (vLLM's AVX-512 build does, its AVX2 build does not); then one rounding to bf16. Rows stored
   as codes (kv_format.py) are dequantised on the way, per head, into a row on the stack:
   value(code) * scale + zero in fp32 (an exact product: one rounding either way), rounded to
   bf16, as torch computes it in the portable chain; an integer code's value is the integer,
   an fp8 code's its e4m3 number. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* copy whole 64-byte lines from an aligned buffer past the caches: no read for ownership of
   the target lines (they are read next by attention, from memory either way at k = 50) */
static inline void stream_lines(void *dst, const void *src, int64_t bytes) {
#if defined(__x86_64__)
    if ((uintptr_t)dst % 16) {
        memcpy(dst, src, bytes);
        return;
    }
    __m128i *d = (__m128i *)dst;
    const __m128i *s = (const __m128i *)src;
    for (int64_t i = 0; i < bytes / 16; i++) _mm_stream_si128(d + i, _mm_load_si128(s + i));
#else
    memcpy(dst, src, bytes);
#endif
}

#define GROUP 16      /* tokens per packed group of the "amx" key layout */
#define MAX_DIM 256

enum { LAYOUT_AMX = 0, LAYOUT_VEC = 1 };

#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=sapphirerapids", "arch=skylake-avx512", "arch=haswell", "default")))
#else
#define CLONES
#endif

static inline float bf(uint16_t x) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)x << 16 };
    return v.f;
}

/* fp32 -> bf16, round to nearest even (torch's rounding) */
static inline uint16_t rbf(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    if (f != f) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

typedef struct {
    int64_t layout, heads, dim, rot, block_size, tokens;
    const int64_t *piece_k, *piece_v;  /* per token: address of its layer-0 K / V row */
    const int64_t *layer_stride;       /* per token: row elements between its layers */
    const int64_t *bits;               /* per token: 16 (bf16 rows) or 8, 4, 2 (codes) */
    const int64_t *fp8;                /* per token: 1 where its 8-bit codes are e4m3 */
    const int64_t *k_params;           /* per token: its blob's layer-0 [heads][2][dim] */
    const int64_t *v_params;           /* per token: its layer-0 [heads][2] */
    const int64_t *v_params_stride;    /* per token: elements between its layers' params */
    const int64_t *slots;              /* [groups][tokens]: each token's slot, -1: not written */
    const int64_t *groups;             /* per layer: its row of slots */
    const int64_t *positions;
    const uint16_t *cos_sin;           /* [tables * max_position][rot]: cos | sin */
    const int64_t *layer_rows;         /* per layer: the first row of its table in cos_sin */
    const uint16_t *scales;            /* [layers][tokens] bf16 key scales, or NULL */
    const int64_t *caches;             /* per layer: address of its cache */
} job_t;

static inline const char *row_of(const int64_t *base, const job_t *j, int64_t layer,
                                 int64_t t) {
    return (const char *)(intptr_t)base[t] + layer * j->layer_stride[t] * (j->bits[t] == 16 ? 2 : 1);
}

/* the value of each e4m3 (float8_e4m3fn) byte: no infinities, 0x7F and 0xFF NaN */
static float e4m3_values[256];

static void fill_e4m3_values(void) {
    for (uint32_t c = 0; c < 256; c++) {
        const uint32_t sign = (c >> 7) << 31, e = (c >> 3) & 15, m = c & 7;
        union { uint32_t u; float f; } v = { .u = sign | (e + 120) << 23 | m << 20 };
        if (e == 0) v.f = (sign ? -1.0f : 1.0f) * (float)m / 512.0f;  /* subnormal: m * 2^-9 */
        if (e == 15 && m == 7) v.u = 0x7FC00000u;
        e4m3_values[c] = v.f;
    }
}

/* one head's row of b-bit codes (fp8: e4m3 bytes) dequantised into out[dim]: per element
   scale[d * step] and zero[d * step] (keys: per channel, step 1; values: one pair, step 0).
   The codes are unpacked byte by byte into floats first, then one multiply-add and rounding
   per element: both loops vectorise. */
static inline __attribute__((always_inline)) void dequant(
        uint16_t *out, const uint8_t *codes, int bits, int fp8, int64_t dim,
        const uint16_t *scale, const uint16_t *zero, int64_t step) {
    float q[MAX_DIM];
    if (fp8) {
        for (int64_t d = 0; d < dim; d++) q[d] = e4m3_values[codes[d]];
    } else if (bits == 8) {
        for (int64_t d = 0; d < dim; d++) q[d] = (float)codes[d];
    } else if (bits == 4) {
        for (int64_t i = 0; i < dim / 2; i++) {
            q[2 * i] = (float)(codes[i] & 15);
            q[2 * i + 1] = (float)(codes[i] >> 4);
        }
    } else {
        for (int64_t i = 0; i < dim / 4; i++) {
            q[4 * i] = (float)(codes[i] & 3);
            q[4 * i + 1] = (float)((codes[i] >> 2) & 3);
            q[4 * i + 2] = (float)((codes[i] >> 4) & 3);
            q[4 * i + 3] = (float)(codes[i] >> 6);
        }
    }
    if (step) {
        for (int64_t d = 0; d < dim; d++) out[d] = rbf(q[d] * bf(scale[d]) + bf(zero[d]));
    } else {
        const float s = bf(scale[0]), z = bf(zero[0]);
        for (int64_t d = 0; d < dim; d++) out[d] = rbf(q[d] * s + z);
    }
}

static inline void dequant_row(uint16_t *out, const uint8_t *codes, int64_t bits, int64_t fp8,
                               int64_t dim, const uint16_t *scale, const uint16_t *zero,
                               int64_t step) {
    if (fp8) {
        dequant(out, codes, 8, 1, dim, scale, zero, step);
        return;
    }
    switch (bits) {
    case 8: dequant(out, codes, 8, 0, dim, scale, zero, step); break;
    case 4: dequant(out, codes, 4, 0, dim, scale, zero, step); break;
    default: dequant(out, codes, 2, 0, dim, scale, zero, step); break;
    }
}

CLONES static void inject_layer(const job_t *j, int64_t layer) {
    const int64_t heads = j->heads, dim = j->dim, rot = j->rot, half = rot / 2;
    const int64_t bs = j->block_size, tokens = j->tokens, row = heads * dim;
    uint16_t *cache = (uint16_t *)(intptr_t)j->caches[layer];
    const int64_t *slots = j->slots + j->groups[layer] * tokens;
    uint16_t tile[GROUP][MAX_DIM] __attribute__((aligned(64)));
    uint16_t kdq[GROUP][MAX_DIM], vdq[GROUP][MAX_DIM];  /* dequantised rows of one head */
    float cs[GROUP][MAX_DIM], scale[GROUP];
    const char *ksrc[GROUP], *vsrc[GROUP];
    const uint16_t *kr[GROUP], *vr[GROUP];  /* one head's bf16 K / V row per token */
    int64_t t = 0;
    while (t < tokens) {
        if (slots[t] < 0) {  /* a block this layer's group does not keep */
            t++;
            continue;
        }
        int64_t s0 = slots[t], block = s0 / bs, o0 = s0 % bs, n = 1;
        while (t + n < tokens && n < GROUP && slots[t + n] == s0 + n && (o0 + n) % GROUP)
            n++;
        for (int64_t i = t + n; i < t + n + GROUP && i < tokens; i++) {
            const char *kp = row_of(j->piece_k, j, layer, i);
            const char *vp = row_of(j->piece_v, j, layer, i);
            for (int64_t b = 0; b < row * j->bits[i] / 8; b += 64) {
                __builtin_prefetch(kp + b);
                __builtin_prefetch(vp + b);
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const uint16_t *table =
                j->cos_sin + (j->layer_rows[layer] + j->positions[t + i]) * rot;
            float f = j->scales ? bf(j->scales[layer * tokens + t + i]) : 1.0f;
            for (int64_t d = 0; d < rot; d++) cs[i][d] = bf(rbf(bf(table[d]) * f));
            scale[i] = f;
            ksrc[i] = row_of(j->piece_k, j, layer, t + i);
            vsrc[i] = row_of(j->piece_v, j, layer, t + i);
        }
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t i = 0; i < n; i++) {
                const int64_t bits = j->bits[t + i];
                if (bits == 16) {
                    kr[i] = (const uint16_t *)ksrc[i] + h * dim;
                    vr[i] = (const uint16_t *)vsrc[i] + h * dim;
                    continue;
                }
                const uint16_t *kp = (const uint16_t *)(intptr_t)j->k_params[t + i] +
                                     (layer * heads + h) * 2 * dim;
                const uint16_t *vp = (const uint16_t *)(intptr_t)j->v_params[t + i] +
                                     layer * j->v_params_stride[t + i] + h * 2;
                const int64_t code_row = dim * bits / 8, fp8 = j->fp8[t + i];
                dequant_row(kdq[i], (const uint8_t *)ksrc[i] + h * code_row, bits, fp8, dim,
                            kp, kp + dim, 1);
                dequant_row(vdq[i], (const uint8_t *)vsrc[i] + h * code_row, bits, fp8, dim,
                            vp, vp + 1, 0);
                kr[i] = kdq[i];
                vr[i] = vdq[i];
            }
            for (int64_t i = 0; i < n; i++) {
                const uint16_t *src = kr[i];
                const float *c = cs[i], *s = cs[i] + half;
                for (int64_t d = 0; d < half; d++) {
                    float x1 = bf(src[d]), x2 = bf(src[d + half]);
                    tile[i][d] = rbf(x1 * c[d] - x2 * s[d]);
                    tile[i][d + half] = rbf(x2 * c[d] + x1 * s[d]);
                }
                for (int64_t d = rot; d < dim; d++) tile[i][d] = rbf(bf(src[d]) * scale[i]);
            }
            uint16_t *kdst = cache + (block * heads + h) * 2 * bs * dim, *vdst = kdst + bs * dim;
            if (j->layout == LAYOUT_AMX) {
                /* K: [bs/16][dim/2][16 tokens][2 dims]; V: [dim/16][bs/2][16 dims][2 tokens] */
                uint32_t *k32 = (uint32_t *)kdst + (o0 / GROUP) * GROUP * (dim / 2) + o0 % GROUP;
                if (n == GROUP) {  /* whole group: whole lines */
                    uint32_t kt[MAX_DIM / 2 * GROUP] __attribute__((aligned(64)));
                    uint32_t vt[GROUP * 16] __attribute__((aligned(64)));
                    for (int64_t dp = 0; dp < dim / 2; dp++)
                        for (int64_t i = 0; i < GROUP; i++)
                            kt[dp * GROUP + i] = ((const uint32_t *)tile[i])[dp];
                    stream_lines(k32, kt, GROUP * dim * 2);
                    for (int64_t g = 0; g < dim / 16; g++) {
                        for (int64_t p = 0; p < GROUP / 2; p++) {
                            const uint16_t *a = vr[2 * p] + g * 16;
                            const uint16_t *b = vr[2 * p + 1] + g * 16;
                            for (int64_t d = 0; d < 16; d++)
                                vt[p * 16 + d] = (uint32_t)a[d] | ((uint32_t)b[d] << 16);
                        }
                        stream_lines((uint32_t *)vdst + g * bs * 8 + (o0 / 2) * 16, vt,
                                     GROUP * 16 * 2);
                    }
                    continue;
                }
                for (int64_t dp = 0; dp < dim / 2; dp++)
                    for (int64_t i = 0; i < n; i++)
                        k32[dp * GROUP + i] = ((const uint32_t *)tile[i])[dp];
                for (int64_t i = 0; i < n;) {
                    int64_t off = o0 + i;
                    const uint16_t *a = vr[i];
                    if (off % 2 == 0 && i + 1 < n) {
                        const uint16_t *b = vr[i + 1];
                        uint32_t *v32 = (uint32_t *)vdst + (off / 2) * 16;
                        for (int64_t g = 0; g < dim / 16; g++)
                            for (int64_t d = 0; d < 16; d++)
                                v32[g * bs * 8 + d] = (uint32_t)a[g * 16 + d] |
                                                      ((uint32_t)b[g * 16 + d] << 16);
                        i += 2;
                    } else {
                        uint16_t *v16 = vdst + (off / 2) * 32 + off % 2;
                        for (int64_t g = 0; g < dim / 16; g++)
                            for (int64_t d = 0; d < 16; d++)
                                v16[g * bs * 16 + d * 2] = a[g * 16 + d];
                        i += 1;
                    }
                }
            } else {
                /* K: [dim][bs]; V: [bs][dim] */
                for (int64_t d = 0; d < dim; d++)
                    for (int64_t i = 0; i < n; i++)
                        kdst[d * bs + o0 + i] = tile[i][d];
                for (int64_t i = 0; i < n; i++)
                    memcpy(vdst + (o0 + i) * dim, vr[i], dim * sizeof(uint16_t));
            }
        }
        t += n;
    }
#if defined(__x86_64__)
    _mm_sfence();  /* the streamed lines are visible before attention reads them */
#endif
}

static int supported(const job_t *j) {
    return (j->layout == LAYOUT_AMX || j->layout == LAYOUT_VEC) && j->heads > 0 &&
           j->dim > 0 && j->dim <= MAX_DIM && j->dim % 16 == 0 && j->rot % 2 == 0 &&
           j->rot <= j->dim && j->block_size > 0 && j->block_size % GROUP == 0 &&
           j->tokens >= 0;
}

/* inject(layout, layers, heads, dim, rot, block_size, tokens, piece_k, piece_v, layer_stride,
          bits, fp8, k_params, v_params, v_params_stride, slots, groups, positions, cos_sin,
          layer_rows, scales, caches):
   addresses are ints (0: no scales); the per-token tables are int64 */
static PyObject *inject(PyObject *self, PyObject *args) {
    job_t j;
    int64_t layers, a[15];
    if (!PyArg_ParseTuple(args, "LLLLLLLLLLLLLLLLLLLLLL", &j.layout, &layers, &j.heads, &j.dim,
                          &j.rot, &j.block_size, &j.tokens, &a[0], &a[1], &a[2], &a[3], &a[4],
                          &a[5], &a[6], &a[7], &a[8], &a[9], &a[10], &a[11], &a[12], &a[13],
                          &a[14]))
        return NULL;
    if (!supported(&j) || layers < 0) {
        PyErr_SetString(PyExc_ValueError, "fused KV write: unsupported shape or layout");
        return NULL;
    }
    j.piece_k = (const int64_t *)(intptr_t)a[0];
    j.piece_v = (const int64_t *)(intptr_t)a[1];
    j.layer_stride = (const int64_t *)(intptr_t)a[2];
    j.bits = (const int64_t *)(intptr_t)a[3];
    j.fp8 = (const int64_t *)(intptr_t)a[4];
    j.k_params = (const int64_t *)(intptr_t)a[5];
    j.v_params = (const int64_t *)(intptr_t)a[6];
    j.v_params_stride = (const int64_t *)(intptr_t)a[7];
    j.slots = (const int64_t *)(intptr_t)a[8];
    j.groups = (const int64_t *)(intptr_t)a[9];
    j.positions = (const int64_t *)(intptr_t)a[10];
    j.cos_sin = (const uint16_t *)(intptr_t)a[11];
    j.layer_rows = (const int64_t *)(intptr_t)a[12];
    j.scales = (const uint16_t *)(intptr_t)a[13];
    j.caches = (const int64_t *)(intptr_t)a[14];
    Py_BEGIN_ALLOW_THREADS
    /* dynamic: a sliding-window layer may write only its window's tokens */
#pragma omp parallel for schedule(dynamic)
    for (int64_t layer = 0; layer < layers; layer++) inject_layer(&j, layer);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"inject", inject, METH_VARARGS,
     "Rotate, scale and write K/V rows into a vLLM CPU paged cache (see kvwrite.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused_cpu(void) {
    fill_e4m3_values();
    return PyModule_Create(&module);
}
