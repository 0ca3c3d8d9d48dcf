/* CPU fast path: matmuls over weights in every format of the registry (qserve/formats: dense
 * fp32/fp16/bf16, qserve's packed int4/int8, GGML blocks read in place; the GGML kernels are in
 * kernels/cpu_formats.c, included below), decode-time paged attention and KV writes over
 * fp32/fp16/bf16/int8/int4 KV blocks (int4 KV: keys coded per channel through the layer's
 * calibrated codebook, values as rotated 4-bit codes; kernels/kv_quant.py), and the fused decode
 * step over all layers.
 *
 * GNU C11 (-std=gnu11: _Float16, __attribute__) + OpenMP. Hot loops are written with AVX2/
 * FMA/F16C intrinsics where the build machine has them (-march=native), with portable loops for
 * gcc/clang to vectorize elsewhere (#else branches). No torch headers: kernels/cpu_ops.py
 * compiles this file once per machine and calls it through ctypes. Every function has a
 * pure-torch reference (qserve/formats, kernels/paged_attention.py, kernels/kv_quant.py) that
 * tests/test_cpu_ops.py and tests/test_cpu_formats.py compare it against.
 *
 * A weight matrix is passed as one wdesc (below; kernels/cpu_ops.py WDesc). qserve's own layouts
 * (qserve/formats/qtensor.py):
 *   int4  qweight uint8 (N, Kp / 2): byte j of a row holds input 2j (low nibble) and 2j + 1
 *         (high nibble); w = q * scale + offset (asymmetric) or (q - 8) * scale (symmetric)
 *   int4z the same codes, w = (q - zero) * scale with integer zero points (AWQ / GPTQ): the
 *         kernels take it as int4 with offset -zero * scale, computed in fp32, where it is
 *         exact (an 8-bit zero times an fp16 scale), so the weights are the reference's
 *   int8  qweight int8 (N, Kp): w = q * scale
 *   scales, offsets fp16 (N, Kp / group_size); int4z zeros uint8 (N, Kp / group_size)
 * Kp is a multiple of 32 for int4/int4z (group sizes 32/64/128); int8 may have any Kp.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef _Float16 half;

#define CHUNK 32 /* inputs per inner step: one int4 chunk is 16 bytes */
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_ZMM_PATH 1 /* the 512-bit int8-activation row kernels (q4_row_z and others) */
#endif
#define MT 4     /* activation rows that share one dequantized weight chunk (fp32 activations) */
#define MTI 8    /* the same with int8 activations, whose per-row state is one register */
#define NR 4     /* fp32 weight rows that share each activation load (f32_rows) */

/* Weight kinds: qserve/formats/registry.py KIND_* and GGML_KIND_BASE + the GGML type id. */
enum {
    KIND_F32 = 0, KIND_INT4 = 1, KIND_INT8 = 2, KIND_F16 = 3, KIND_BF16 = 4, KIND_INT4Z = 5,
    KIND_Q4_K_X16 = 6, KIND_Q6_K_X16 = 7, KIND_INT4_X16 = 8, /* 16 rows interleaved
                                           * (kernels/cpu_formats.c; AVX-512 VNNI, and
                                           * AVX2 but q6_k_x16) */
    KIND_Q5_0 = 16 + 6, KIND_Q5_1 = 16 + 7, KIND_Q2_K = 16 + 10, KIND_Q3_K = 16 + 11,
    KIND_Q4_K = 16 + 12, KIND_Q5_K = 16 + 13, KIND_Q6_K = 16 + 14, KIND_IQ4_NL = 16 + 20,
    KIND_IQ4_XS = 16 + 23, KIND_MXFP4 = 16 + 39,
};

/* One weight matrix W (N, K), y = x W^T + bias (kernels/cpu_ops.py WDesc, same field order). */
typedef struct {
    int64_t kind;
    const void *w;       /* f32/f16/bf16 (N, K); int4/int8 qweight; GGML rows (N, row_bytes) */
    const half *scales;  /* int4/int4z/int8 (N, Kp / group_size), else NULL */
    union {
        const half *offsets; /* int4 asymmetric, else NULL */
        const uint8_t *zeros; /* int4z: the zero points, shaped as the scales */
    };
    const float *bias;   /* (N,) or NULL */
    int64_t N, K;
    int64_t Kp;          /* int4/int4z/int8: K padded to whole groups; others K */
    int64_t group_size;  /* int4/int4z/int8: inputs per scale; GGML: per block; dense 1 */
    int64_t row_bytes;   /* bytes from one row of w to the next */
} wdesc;
_Static_assert(sizeof(wdesc) == 10 * sizeof(int64_t), "wdesc is WDesc's 10 8-byte fields");

/* CALL(k) with k the constant 1, 2, 3 or MT equal to mt: each row kernel is then specialized
 * for its row count and keeps its accumulators in registers. */
#define FOR_EACH_MT(mt, CALL) \
    switch (mt) {             \
    case 1: CALL(1); break;   \
    case 2: CALL(2); break;   \
    case 3: CALL(3); break;   \
    default: CALL(MT);        \
    }
#define FOR_EACH_MTI(mt, CALL) \
    switch (mt) {              \
    case 1: CALL(1); break;    \
    case 2: CALL(2); break;    \
    case 3: CALL(3); break;    \
    case 4: CALL(4); break;    \
    case 5: CALL(5); break;    \
    case 6: CALL(6); break;    \
    case 7: CALL(7); break;    \
    default: CALL(MTI);        \
    }

#ifdef __F16C__
#include <immintrin.h>
#endif
/* out[0..n) = the fp16 values h[0..n), 8 at a time where F16C is; returns out */
static inline float *halves_to_floats(const half *h, float *out, int64_t n)
{
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++)
        out[i] = (float)h[i];
    return out;
}

static inline int is_int4(const wdesc *W)
{
    return W->kind == KIND_INT4 || W->kind == KIND_INT4Z;
}

/* The G offsets o of row n of an int4 / int4z matrix as floats into out, from the row's scales
 * sc (floats): int4's fp16 offsets, int4z's -z s (exact in fp32); NULL when symmetric. */
static inline const float *int4_offsets(const wdesc *W, int64_t n, int64_t G, const float *sc,
                                        float *out)
{
    if (W->kind == KIND_INT4Z) {
        for (int64_t g = 0; g < G; g++)
            out[g] = -(float)W->zeros[n * G + g] * sc[g];
        return out;
    }
    return W->offsets ? halves_to_floats(W->offsets + n * G, out, G) : NULL;
}

/* Rows of a matmul (or a dequantization) that one thread takes at a time: OpenMP hands out
 * these items as threads come for them (schedule(dynamic)), so when the OS deschedules one of
 * our threads to run another process, the others take its share instead of waiting for it at
 * the end of the loop (a static split stalls every parallel region for a time slice then).
 * An item is at least ROW_ITEM rows and about ITEM_BYTES of weights: each thread then streams
 * 16x the prefetch distance of consecutive rows before it jumps, where 16 rows of a narrow
 * matrix were ~5 KB, most of it read before its prefetches landed (the default model's int4
 * rows are 288 bytes: batch-1 decode at 2 threads rose ~10-20% with 32 KiB items, on a noisy
 * machine; 1B rows are 1-7 KB, so their items hardly change). */
#define ROW_ITEM 16
#define ITEM_BYTES 32768
static inline int64_t row_item(int64_t row_bytes)
{
    const int64_t rows = ITEM_BYTES / (row_bytes > 0 ? row_bytes : 1);
    return rows > ROW_ITEM ? rows : ROW_ITEM;
}

/* Rows a thread takes at a time where the weights stream from DRAM (the int8-activation row
 * kernels): runs of consecutive rows, 4 a thread (at least row_item's), each one stream the
 * prefetches run ahead in. Items of ~32 KB handed out in turn interleave the threads' reads:
 * int4 8192 x 2048 at batch 1, 2 threads, read 19.7 GB/s so against 51 from cache. Still
 * taken as threads ask, so a thread slowed by another process takes fewer. */
static inline int64_t run_item(int64_t N, int64_t row_bytes, int nthreads)
{
    const int64_t run = (N + 4 * nthreads - 1) / (4 * (int64_t)nthreads);
    const int64_t min = row_item(row_bytes);
    return run > min ? run : min;
}

/* ---- dequant-matmul ----------------------------------------------------------------------- */

/* Activations are permuted chunk-wise so that int4 bytes are read straight: within each
 * 32-input chunk the low nibbles are the even inputs and the high nibbles the odd ones, so
 * xp[c*32 + j] = x[c*32 + 2j] and xp[c*32 + 16 + j] = x[c*32 + 2j + 1] (j < 16). Inputs past K
 * (the padded last group) are 0. int8 weights need no permutation (permute = 0). */
static float *pack_activations(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t Kc,
                               int permute)
{
    float *xp = aligned_alloc(64, (sizeof(float) * (size_t)(M * Kc) + 63) / 64 * 64);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *xpr = xp + m * Kc;
        for (int64_t k = 0; k < Kc; k++) {
            const int64_t c = k / CHUNK, j = k % CHUNK;
            const int64_t e = permute ? c * CHUNK + (j < CHUNK / 2 ? 2 * j : 2 * (j - CHUNK / 2) + 1)
                                      : k;
            xpr[k] = e < K ? xr[e] : 0.f;
        }
    }
    return xp;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* Ask for the cache lines PF_AHEAD bytes past p .. p + n. A row kernel streams its weight rows
 * (and the rows after them, which the same thread takes next) from memory, and the hardware
 * prefetcher alone keeps too few lines in flight while the core is busy unpacking: on the 1B
 * Q4_K_M shape, all layers' matmuls at batch 1 read 4.2 GB/s on one core without this and
 * 9.5 GB/s with it (PF_AHEAD 1-3 KiB were alike; 4 KiB and more fell back). */
#ifndef PF_AHEAD
#define PF_AHEAD 2048
#endif
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *p, int n)
{
    for (int o = 0; o < n; o += 64)
        _mm_prefetch((const char *)(p + PF_AHEAD + o), _MM_HINT_T0);
}

/* 8 bytes -> 8 floats (unsigned / signed). */
static inline __m256 u8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
static inline __m256 i8_to_ps(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }

/* One weight row against `mt` (<= MT) activation rows. Each 32-input chunk of the row is
 * dequantized into four 8-float registers once, then multiplied into every activation row;
 * always_inline with a constant mt, so the two accumulators per row stay in registers. */
static inline __attribute__((always_inline)) void
q4_row(const uint8_t *row, const float *sc, const float *of, int64_t nchunk, int64_t per_group,
       const float *xp, int64_t Kc, const int mt, float *res)
{
    __m256 a0[MT], a1[MT];
    for (int i = 0; i < mt; i++)
        a0[i] = a1[i] = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(15);
    /* g = c / per_group, counted rather than divided (an idiv per chunk is slow) */
    for (int64_t c = 0, g = 0, gc = 0; c < nchunk;
         c++, gc = gc + 1 == per_group ? 0 : gc + 1, g += gc == 0) {
        const float s = sc[g], o = of ? of[g] : -8.f * s;
        const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
        if ((c & 3) == 0)
            prefetch_ahead(row + c * (CHUNK / 2), 1);
        const __m128i b = _mm_loadu_si128((const __m128i *)(row + c * (CHUNK / 2)));
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m256 w0 = _mm256_fmadd_ps(u8_to_ps(lo), vs, vo);                    /* 0..7 */
        const __m256 w1 = _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(lo, 8)), vs, vo); /* 8..15 */
        const __m256 w2 = _mm256_fmadd_ps(u8_to_ps(hi), vs, vo);                    /* 16..23 */
        const __m256 w3 = _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(hi, 8)), vs, vo); /* 24..31 */
        for (int i = 0; i < mt; i++) {
            const float *xc = xp + i * Kc + c * CHUNK;
            a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xc), a0[i]);
            a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + 8), a1[i]);
            a0[i] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xc + 16), a0[i]);
            a1[i] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xc + 24), a1[i]);
        }
    }
    for (int i = 0; i < mt; i++)
        res[i] = hsum(_mm256_add_ps(a0[i], a1[i]));
}

/* int8: chunks of 32 inputs inside one group (group sizes are multiples of 32, or one group
 * per row, whose length may leave a scalar tail). */
static inline __attribute__((always_inline)) void
q8_row(const int8_t *row, const float *sc, int64_t Kp, int64_t group_size,
       const float *xp, int64_t Kc, const int mt, float *res)
{
    __m256 a0[MT], a1[MT];
    for (int i = 0; i < mt; i++)
        a0[i] = a1[i] = _mm256_setzero_ps();
    const int64_t full = group_size % CHUNK == 0 ? Kp
                         : group_size == Kp ? Kp / CHUNK * CHUNK : 0;
    for (int64_t k0 = 0; k0 < full; k0 += CHUNK) {
        const __m256 vs = _mm256_set1_ps(sc[k0 / group_size]);
        if ((k0 & 63) == 0)
            prefetch_ahead((const uint8_t *)row + k0, 1);
        const __m128i b0 = _mm_loadu_si128((const __m128i *)(row + k0));
        const __m128i b1 = _mm_loadu_si128((const __m128i *)(row + k0 + 16));
        const __m256 w0 = _mm256_mul_ps(i8_to_ps(b0), vs);
        const __m256 w1 = _mm256_mul_ps(i8_to_ps(_mm_srli_si128(b0, 8)), vs);
        const __m256 w2 = _mm256_mul_ps(i8_to_ps(b1), vs);
        const __m256 w3 = _mm256_mul_ps(i8_to_ps(_mm_srli_si128(b1, 8)), vs);
        for (int i = 0; i < mt; i++) {
            const float *xc = xp + i * Kc + k0;
            a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xc), a0[i]);
            a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xc + 8), a1[i]);
            a0[i] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xc + 16), a0[i]);
            a1[i] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xc + 24), a1[i]);
        }
    }
    for (int i = 0; i < mt; i++) {
        float t = hsum(_mm256_add_ps(a0[i], a1[i]));
        for (int64_t k = full; k < Kp; k++)
            t += (float)row[k] * sc[k / group_size] * xp[i * Kc + k];
        res[i] = t;
    }
}

/* Dense fp32 weights (the fp32 model's linears in the fused decode step): nr (<= NR, a
 * constant once inlined) consecutive weight rows, row stride K, against one activation row,
 * two accumulators per weight row. Every output's arithmetic is the same whatever nr and
 * whatever the batch, so results are batch-invariant. The weight rows stay in L1 while the
 * activation rows stream past them, so each activation load from L2 feeds nr rows. */
static inline __attribute__((always_inline)) void
f32_rows(const float *w, int64_t K, const float *x, const int nr, float *res)
{
    __m256 a0[NR], a1[NR];
    for (int r = 0; r < nr; r++)
        a0[r] = a1[r] = _mm256_setzero_ps();
    const int64_t full = K / 16 * 16;
    for (int64_t k0 = 0; k0 < full; k0 += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + k0), x1 = _mm256_loadu_ps(x + k0 + 8);
        for (int r = 0; r < nr; r++) {
            prefetch_ahead((const uint8_t *)(w + r * K + k0), 1);
            a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k0), x0, a0[r]);
            a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k0 + 8), x1, a1[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float t = hsum(_mm256_add_ps(a0[r], a1[r]));
        for (int64_t k = full; k < K; k++)
            t += w[r * K + k] * x[k];
        res[r] = t;
    }
}

/* ---- int8-activation path (what llama.cpp does on CPUs) ----
 * Each 32-input chunk of each activation row is quantized to int8 with its own scale
 * d = max|x| / 127 (q_x = round(x / d)), so a chunk's dot product with int4 codes is one integer
 * multiply-add: for w = q_w * s + o,
 *     sum_j w_j x_j ~ s * d * sum_j q_w,j q_x,j  +  o * d * sum_j q_x,j
 * _mm256_maddubs_epi16 multiplies unsigned codes (0..15, or |int8|) by signed int8 activations
 * and adds pairs into int16 without overflow (2 * 15 * 127, 2 * 127 * 127 < 32767). */
typedef struct {
    int8_t *q;      /* (M, Kp), chunk-permuted like the fp32 path when int4 */
    int64_t Mp;     /* M rounded up to MTI */
    float *d;       /* (Kp / 32, Mp) chunk scales, transposed: one chunk's rows are adjacent */
    float *dsum;    /* (Kp / 32, Mp) d * sum(q_x) of the chunk */
    float *dsum16;  /* (Kp / 16, Mp) d * sum(q_x) of each 16 inputs, for the GGML K-quants'
                     * 16-input sub-blocks; NULL unless asked for */
    float *drow;    /* (M, Kp / 32) d again, row-major, and d * sum(q_x) (dsrow), for the */
    float *dsrow;   /* 512-bit row kernels (ACT_QUADS, ACT_U8): they read 16 chunks of a row */
} qacts;

/* How quantize_activations lays out each row's codes for the row kernel that reads them. */
enum {
    ACT_PLAIN = 0, /* input order (int8 weights, GGML blocks) */
    ACT_NIBBLE,    /* per chunk: the 16 even inputs, then the 16 odd ones (int4's nibble order) */
    ACT_QUADS,     /* int4, 512-bit: per 4 chunks c .. c + 3 (c % 4 == 0), the 16 even codes
                    * of each, then the 16 odd codes of each: a 64-byte load of their weights
                    * unpacks into the same two orders (q4_row_z). Chunks past the last whole
                    * 4 stay in ACT_NIBBLE order. */
    ACT_U8,        /* input order, codes + 128 as unsigned bytes: the 512-bit multiply-add
                    * takes one unsigned operand, and int8 weights are signed (q8_row_z) */
};

static inline int hsum_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* 32 fp32 values v -> their int8 codes per the int8-activation scheme, in order, as 32 bytes;
 * *d = the step amax / 127, q = the codes as int32 (8 a vector, for their sums). Activations
 * (quantize_activations) and the int8 GEMM's weights are rounded by this one function:
 *     q = round-to-nearest-even(x * (127 / amax)), the quotient correctly rounded in fp32
 * (_mm256_cvtps_epi32 rounds as nearbyintf does in the default rounding mode). */
static inline __m256i chunk_to_i8(const float *v, float *d, __m256i q[4])
{
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 x8[4], mx = _mm256_setzero_ps();
    for (int u = 0; u < 4; u++) {
        x8[u] = _mm256_loadu_ps(v + 8 * u);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x8[u]));
    }
    const float amax = hmax(mx);
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    *d = amax / 127.f;
    for (int u = 0; u < 4; u++)
        q[u] = _mm256_cvtps_epi32(_mm256_mul_ps(x8[u], _mm256_set1_ps(id)));
    /* 32 int32 in [-127, 127] -> 32 int8 in order (the packs interleave 128-bit lanes) */
    return _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static qacts quantize_activations(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t Kp,
                                  int layout, int sums16, int nthreads)
{
    const int64_t nchunk = Kp / CHUNK, Mp = (M + MTI - 1) / MTI * MTI;
#ifdef HAVE_ZMM_PATH
    const int rows = 1; /* every 512-bit row kernel reads them */
#else
    const int rows = 0;
#endif
    qacts a = {aligned_alloc(64, (size_t)((M * Kp + 63) / 64 * 64)), Mp,
               calloc((size_t)(nchunk * Mp), sizeof(float)),
               calloc((size_t)(nchunk * Mp), sizeof(float)),
               sums16 ? calloc((size_t)(2 * nchunk * Mp), sizeof(float)) : NULL,
               rows ? malloc(sizeof(float) * (size_t)(M * nchunk)) : NULL,
               rows ? malloc(sizeof(float) * (size_t)(M * nchunk)) : NULL};
    float *xp = pack_activations(x, M, K, ldx, Kp, layout == ACT_NIBBLE || layout == ACT_QUADS);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 4)
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < nchunk; c++) {
            __m256i q[4];
            float d;
            const __m256i q16 = chunk_to_i8(xp + m * Kp + c * CHUNK, &d, q);
            int8_t *dst = a.q + m * Kp;
            if (layout == ACT_QUADS && c < nchunk / 4 * 4) { /* halves 64 bytes apart */
                int8_t *even = dst + (c & ~(int64_t)3) * CHUNK + (c & 3) * (CHUNK / 2);
                _mm_storeu_si128((__m128i *)even, _mm256_castsi256_si128(q16));
                _mm_storeu_si128((__m128i *)(even + 2 * CHUNK), _mm256_extracti128_si256(q16, 1));
            } else
                _mm256_storeu_si256((__m256i *)(dst + c * CHUNK),
                                    layout == ACT_U8 ? _mm256_xor_si256(q16, flip) : q16);
            const __m256i s0 = _mm256_add_epi32(q[0], q[1]), s1 = _mm256_add_epi32(q[2], q[3]);
            const float dsum = d * (float)hsum_epi32(_mm256_add_epi32(s0, s1));
            a.d[c * Mp + m] = d;
            a.dsum[c * Mp + m] = dsum;
            if (rows) {
                a.drow[m * nchunk + c] = d;
                a.dsrow[m * nchunk + c] = dsum;
            }
            if (sums16) { /* inputs 0..15 and 16..31 */
                a.dsum16[2 * c * Mp + m] = d * (float)hsum_epi32(s0);
                a.dsum16[(2 * c + 1) * Mp + m] = d * (float)hsum_epi32(s1);
            }
        }
    free(xp);
    return a;
}

static void free_activations(qacts a)
{
    free(a.q);
    free(a.d);
    free(a.dsum);
    free(a.dsum16);
    free(a.drow);
    free(a.dsrow);
}

/* Lane i of v in all 8 lanes (i a constant once inlined). */
static inline __m256 lane(__m256 v, int i)
{
    return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i));
}

/* One weight row against activation rows m0 .. m0 + mt: per chunk, the row's 32 codes are
 * widened once; each activation row then costs one integer multiply-add, one convert and one
 * fma with its s * d (computed for the MTI rows at once, as is the offset term, and kept in
 * a register: a store and reloads would stall on store-to-load forwarding every chunk). */
static inline __attribute__((always_inline)) void
q4_row_i8(const uint8_t *row, const float *sc, const float *of, int64_t nchunk, int64_t per_group,
          const qacts *a, int64_t m0, int64_t Kp, const int mt, float *res)
{
    __m256 acc[MTI];
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    __m256 off = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    /* g = c / per_group, counted rather than divided (an idiv per chunk is slow) */
    for (int64_t c = 0, g = 0, gc = 0; c < nchunk;
         c++, gc = gc + 1 == per_group ? 0 : gc + 1, g += gc == 0) {
        const float s = sc[g], o = of ? of[g] : -8.f * s;
        if ((c & 3) == 0)
            prefetch_ahead(row + c * (CHUNK / 2), 1);
        const __m128i b = _mm_loadu_si128((const __m128i *)(row + c * (CHUNK / 2)));
        /* bytes 0..15: low nibbles (even inputs), 16..31: high nibbles (odd inputs) */
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), mask);
        const __m256 sd = _mm256_mul_ps(_mm256_set1_ps(s), _mm256_loadu_ps(a->d + c * a->Mp + m0));
        off = _mm256_fmadd_ps(_mm256_set1_ps(o), _mm256_loadu_ps(a->dsum + c * a->Mp + m0), off);
        for (int i = 0; i < mt; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + i) * Kp + c * CHUNK));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), lane(sd, i), acc[i]);
        }
    }
    float offs[MTI];
    _mm256_storeu_ps(offs, off);
    for (int i = 0; i < mt; i++)
        res[i] = hsum(acc[i]) + offs[i];
}

static inline __attribute__((always_inline)) void
q8_row_i8(const int8_t *row, const float *sc, int64_t nchunk, int64_t group_size,
          const qacts *a, int64_t m0, int64_t Kp, const int mt, float *res)
{
    __m256 acc[MTI];
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    /* the group of chunk c, counted: group sizes are multiples of CHUNK, or one group spans
     * the row (then g stays 0) */
    const int64_t per_group = group_size % CHUNK == 0 ? group_size / CHUNK : nchunk;
    for (int64_t c = 0, g = 0, gc = 0; c < nchunk;
         c++, gc = gc + 1 == per_group ? 0 : gc + 1, g += gc == 0) {
        const float s = sc[g];
        if ((c & 1) == 0)
            prefetch_ahead((const uint8_t *)row + c * CHUNK, 1);
        const __m256i w = _mm256_loadu_si256((const __m256i *)(row + c * CHUNK));
        const __m256i aw = _mm256_sign_epi8(w, w); /* |w|, and x takes w's sign */
        const __m256 sd = _mm256_mul_ps(_mm256_set1_ps(s), _mm256_loadu_ps(a->d + c * a->Mp + m0));
        for (int i = 0; i < mt; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + i) * Kp + c * CHUNK));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), lane(sd, i), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++)
        res[i] = hsum(acc[i]);
}


#ifdef HAVE_ZMM_PATH
/* 512-bit row kernels (AVX-512 VNNI). The 256-bit ones spend ~20 instructions per 32-input
 * chunk and activation row's share (nibble unpack, two multiply-adds, the scale products
 * rebuilt from scalars, a lane broadcast per row). These take 2 (int8, Q4_K) or 4 (int4) chunks
 * per step: one load unpacks the weights for every activation row, each row then costs one
 * vpdpbusd per 64 inputs, and a convert and a multiply-add per step, whose scale products
 * s * d come from 16-chunk vectors computed once per 16 chunks (vpermps picks each lane's
 * chunk), as does the offset term o_c * d_c * sum(q_x). 512-bit arithmetic issues on two
 * ports, not three: Q6_K's version (more work per row) ran no faster than its 256-bit kernel,
 * which it keeps. Same sums as the 256-bit kernels, in another order: a row's result still
 * depends on nothing but its own activations (batch-invariant). */

/* Lane -> chunk (of 16) maps of step j: int4 takes chunks 4j .. 4j + 3, 4 lanes each
 * (ACT_QUADS), int8 chunks 2j, 2j + 1, 8 lanes each. */
#define QUAD_IDX(j) _mm512_setr_epi32(4 * (j), 4 * (j), 4 * (j), 4 * (j), 4 * (j) + 1, \
    4 * (j) + 1, 4 * (j) + 1, 4 * (j) + 1, 4 * (j) + 2, 4 * (j) + 2, 4 * (j) + 2, 4 * (j) + 2, \
    4 * (j) + 3, 4 * (j) + 3, 4 * (j) + 3, 4 * (j) + 3)
#define SEQ_IDX(j) _mm512_setr_epi32(2 * (j), 2 * (j), 2 * (j), 2 * (j), 2 * (j), 2 * (j), \
    2 * (j), 2 * (j), 2 * (j) + 1, 2 * (j) + 1, 2 * (j) + 1, 2 * (j) + 1, 2 * (j) + 1, \
    2 * (j) + 1, 2 * (j) + 1, 2 * (j) + 1)

/* Where the scales of a 16-chunk block come from: one masked fp16 load of the groups it spans
 * (g0 .. g0 + popcount(kg)), then lane i takes group idx[i]: the identity when a group is one
 * chunk, [0 0 1 1 ...] for 64-input groups, and so on. Built once per matmul (chunk_blocks). */
typedef struct {
    __m512i idx;
    int64_t g0;
    __mmask16 kg;
} chunk_block;

static chunk_block *chunk_blocks(int64_t nchunk, int64_t per_group)
{
    const int64_t nblk = (nchunk + 15) / 16;
    chunk_block *blk = aligned_alloc(64, (size_t)nblk * sizeof(chunk_block));
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t c0 = 16 * b, n = nchunk - c0 < 16 ? nchunk - c0 : 16;
        int32_t idx[16] = {0};
        blk[b].g0 = c0 / per_group;
        for (int64_t i = 0; i < n; i++)
            idx[i] = (int32_t)((c0 + i) / per_group - blk[b].g0);
        blk[b].kg = (__mmask16)((1u << (idx[n - 1] + 1)) - 1);
        blk[b].idx = _mm512_loadu_si512(idx);
    }
    return blk;
}

/* The 16 chunk values (scales or offsets) of block b of a row whose group values are h. */
static inline __m512 chunk16(const half *h, const chunk_block *b)
{
    return _mm512_permutexvar_ps(b->idx, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(b->kg, h + b->g0)));
}

/* The same from fp32 group values f (int4z's offsets -z s, computed per row). */
static inline __m512 chunk16_f32(const float *f, const chunk_block *b)
{
    return _mm512_permutexvar_ps(b->idx, _mm512_maskz_loadu_ps(b->kg, f + b->g0));
}

/* One int4 row (group scales sh; offsets oh in fp16, or of in fp32 (int4z), or neither:
 * symmetric; blk: chunk_blocks) against activation rows m0 .. m0 + mt (ACT_QUADS codes). A
 * step takes 4 chunks: one 64-byte load holds their codes, whose low nibbles (the even inputs)
 * and high nibbles (the odd ones) line up with the activations' two 64-byte halves, so both
 * multiply-adds add into the same lanes: lanes 4k .. 4k + 3 hold chunk k's sum, converted and
 * scaled once. */
static inline __attribute__((always_inline)) void
q4_row_z(const uint8_t *row, const half *sh, const half *oh, const float *of,
         const chunk_block *blk, int64_t nchunk, const qacts *a, int64_t m0, int64_t Kp,
         const int mt, float *res)
{
    __m512 acc[MTI];
    float sd[MTI][16] __attribute__((aligned(64)));
    for (int i = 0; i < mt; i++)
        acc[i] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi8(15);
    const int64_t quads = nchunk / 4;
    for (int64_t c0 = 0; c0 < nchunk; c0 += 16) {
        const int64_t n = nchunk - c0 < 16 ? nchunk - c0 : 16;
        const int64_t nq = quads - c0 / 4 < 4 ? quads - c0 / 4 : 4; /* whole quads here */
        const __mmask16 k = n == 16 ? 0xffff : (__mmask16)((1u << n) - 1);
        const __m512 s16 = chunk16(sh, blk + c0 / 16);
        const __m512 o16 = of   ? chunk16_f32(of, blk + c0 / 16)
                           : oh ? chunk16(oh, blk + c0 / 16)
                                : _mm512_mul_ps(s16, _mm512_set1_ps(-8.f)); /* symmetric */
        for (int i = 0; i < mt; i++) {
            const int64_t r = (m0 + i) * nchunk + c0;
            _mm512_store_ps(sd[i], _mm512_mul_ps(s16, _mm512_maskz_loadu_ps(k, a->drow + r)));
            acc[i] = _mm512_mask3_fmadd_ps(o16, _mm512_maskz_loadu_ps(k, a->dsrow + r), acc[i], k);
        }
        const uint8_t *wb = row + c0 * (CHUNK / 2);
        prefetch_ahead(wb, 8 * CHUNK);
#define STEP(j)                                                                                 \
        if ((j) < nq) {                                                                         \
            const __m512i wv = _mm512_loadu_si512(wb + (j) * 2 * CHUNK);                        \
            const __m512i lo = _mm512_and_si512(wv, mask);                                      \
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask);               \
            const __m512i idx = QUAD_IDX(j);                                                    \
            for (int i = 0; i < mt; i++) {                                                      \
                const int8_t *xq = a->q + (m0 + i) * Kp + (c0 + 4 * (j)) * CHUNK;               \
                const __m512i p = _mm512_dpbusd_epi32(                                          \
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq)),    \
                    hi, _mm512_loadu_si512(xq + 2 * CHUNK));                                    \
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),                                 \
                                         _mm512_permutexvar_ps(idx, _mm512_load_ps(sd[i])),     \
                                         acc[i]);                                               \
            }                                                                                   \
        }
        STEP(0) STEP(1) STEP(2) STEP(3)
#undef STEP
        for (int64_t t = 4 * nq; t < n; t++) { /* the row's last chunks (ACT_NIBBLE order) */
            const int64_t c = c0 + t;
            const __m128i b = _mm_loadu_si128((const __m128i *)(row + c * (CHUNK / 2)));
            const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b),
                                               _mm256_set1_epi8(15));
            for (int i = 0; i < mt; i++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + i) * Kp +
                                                                        c * CHUNK));
                const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
                acc[i] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(p)),
                                         _mm512_set1_ps(sd[i][t]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        res[i] = _mm512_reduce_add_ps(acc[i]);
}

/* One int8 row (group scales sh; blk: chunk_blocks) against activation rows m0 .. m0 + mt (ACT_U8 codes, q + 128):
 * sum (q_x + 128) q_w - 128 sum q_w, both from vpdpbusd. */
static inline __attribute__((always_inline)) void
q8_row_z(const int8_t *row, const half *sh, const chunk_block *blk, int64_t nchunk,
         const qacts *a, int64_t m0, int64_t Kp, const int mt, float *res)
{
    __m512 acc[MTI];
    float sd[MTI][16] __attribute__((aligned(64)));
    for (int i = 0; i < mt; i++)
        acc[i] = _mm512_setzero_ps();
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int64_t c0 = 0; c0 < nchunk; c0 += 16) {
        const int64_t n = nchunk - c0 < 16 ? nchunk - c0 : 16, pairs = n / 2;
        const __mmask16 k = n == 16 ? 0xffff : (__mmask16)((1u << n) - 1);
        const __m512 s16 = chunk16(sh, blk + c0 / 16);
        for (int i = 0; i < mt; i++)
            _mm512_store_ps(sd[i], _mm512_mul_ps(
                s16, _mm512_maskz_loadu_ps(k, a->drow + (m0 + i) * nchunk + c0)));
        const int8_t *wb = row + c0 * CHUNK;
        prefetch_ahead((const uint8_t *)wb, 16 * CHUNK);
#define STEP(j)                                                                                 \
        if ((j) < pairs) {                                                                      \
            const __m512i w = _mm512_loadu_si512(wb + (j) * 2 * CHUNK);                         \
            const __m512i corr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, w);          \
            const __m512i idx = SEQ_IDX(j);                                                     \
            for (int i = 0; i < mt; i++) {                                                      \
                const __m512i xv = _mm512_loadu_si512(                                          \
                    a->q + (m0 + i) * Kp + (c0 + 2 * (j)) * CHUNK);                             \
                const __m512i p = _mm512_sub_epi32(                                             \
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, w), corr);                  \
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),                                 \
                                         _mm512_permutexvar_ps(idx, _mm512_load_ps(sd[i])),     \
                                         acc[i]);                                               \
            }                                                                                   \
        }
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#undef STEP
        if (n & 1) {
            const int64_t c = c0 + n - 1;
            const __m256i w = _mm256_loadu_si256((const __m256i *)(row + c * CHUNK));
            const __m256i corr = _mm256_dpbusd_epi32(_mm256_setzero_si256(),
                                                     _mm256_set1_epi8((char)0x80), w);
            for (int i = 0; i < mt; i++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + i) * Kp +
                                                                        c * CHUNK));
                const __m256i p = _mm256_sub_epi32(
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), xv, w), corr);
                acc[i] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(p)),
                                         _mm512_set1_ps(sd[i][n - 1]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        res[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif /* HAVE_ZMM_PATH */

#define HAVE_I8_PATH 1
#else
/* Portable versions of the same loops, for compilers/CPUs without AVX2. */
static inline void q4_row(const uint8_t *row, const float *sc, const float *of, int64_t nchunk,
                          int64_t per_group, const float *xp, int64_t Kc, const int mt,
                          float *res)
{
    float acc[MT][CHUNK] = {{0}};
    for (int64_t c = 0; c < nchunk; c++) {
        const int64_t g = c / per_group;
        const float s = sc[g], o = of ? of[g] : -8.f * s;
        const uint8_t *b = row + c * (CHUNK / 2);
        float w[CHUNK];
        for (int j = 0; j < CHUNK / 2; j++) {
            w[j] = (float)(b[j] & 15) * s + o;
            w[CHUNK / 2 + j] = (float)(b[j] >> 4) * s + o;
        }
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < CHUNK; j++)
                acc[i][j] += w[j] * xp[i * Kc + c * CHUNK + j];
    }
    for (int i = 0; i < mt; i++) {
        float t = 0.f;
        for (int j = 0; j < CHUNK; j++)
            t += acc[i][j];
        res[i] = t;
    }
}

static inline void q8_row(const int8_t *row, const float *sc, int64_t Kp, int64_t group_size,
                          const float *xp, int64_t Kc, const int mt, float *res)
{
    for (int i = 0; i < mt; i++) {
        float t = 0.f;
        for (int64_t k = 0; k < Kp; k++)
            t += (float)row[k] * sc[k / group_size] * xp[i * Kc + k];
        res[i] = t;
    }
}

static inline void f32_row(const float *row, int64_t K, const float *xp, int64_t Kc,
                           const int mt, float *res)
{
    for (int i = 0; i < mt; i++) {
        float t = 0.f;
        for (int64_t k = 0; k < K; k++)
            t += row[k] * xp[i * Kc + k];
        res[i] = t;
    }
}

static inline void f32_rows(const float *w, int64_t K, const float *x, const int nr,
                            float *res)
{
    for (int r = 0; r < nr; r++)
        f32_row(w + r * K, K, x, K, 1, res + r);
}
#endif

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias) for qserve's packed int4 or int8 W: x (M, K) fp32
 * with row stride ldx, K <= Kp, y (M, N) with row stride ldy. Parallel over weight rows; each
 * row is read once per MT (fp32) or MTI (int8) activation rows. int8 activations need whole
 * 32-input chunks inside each group (always so for int4); else the fp32 kernels run. */
static void packed_matmul(const wdesc *W, const float *x, int64_t M, int64_t ldx, float *y,
                          int64_t ldy, int i8, int nthreads)
{
    const int four = is_int4(W), zp = W->kind == KIND_INT4Z;
    const int64_t Kp = W->Kp, gs = W->group_size, G = Kp / gs, nchunk = Kp / CHUNK;
    const int64_t row_bytes = four ? Kp / 2 : Kp;
#ifdef HAVE_I8_PATH
    qacts a = {0};
    i8 = i8 && Kp % CHUNK == 0 && gs % CHUNK == 0;
#ifdef HAVE_ZMM_PATH
    const int layout = four ? ACT_QUADS : ACT_U8;
#else /* int4 activations are chunk-permuted like its nibbles (pack_activations) */
    const int layout = four ? ACT_NIBBLE : ACT_PLAIN;
#endif
    if (i8)
        a = quantize_activations(x, M, W->K, ldx, Kp, layout, 0, nthreads);
#ifdef HAVE_ZMM_PATH
    chunk_block *blk = i8 ? chunk_blocks(nchunk, gs / CHUNK) : NULL;
#endif
#else
    i8 = 0;
#endif
    float *xp = i8 ? NULL : pack_activations(x, M, W->K, ldx, Kp, four);
    const int64_t item = run_item(W->N, row_bytes, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, item)
    for (int64_t n = 0; n < W->N; n++) {
        const uint8_t *row = (const uint8_t *)W->w + n * row_bytes;
        const half *sh = W->scales + n * G;
        const half *oh = W->kind == KIND_INT4 && W->offsets ? W->offsets + n * G : NULL;
        /* the row's fp16 scales and offsets as floats, converted 8 at a time: a scalar fp16
         * load per chunk in the row kernels cost more than the chunk's dot product (the
         * 512-bit kernels convert fp16 ones themselves, 16 chunks at a time; int4z's offsets
         * -z s they take as floats) */
        float sc[G], ofs[oh || zp ? G : 1];
        const float *of = NULL;
#ifdef HAVE_ZMM_PATH
        if (!i8 || zp)
#endif
        {
            halves_to_floats(sh, sc, G);
            of = four ? int4_offsets(W, n, G, sc, ofs) : NULL;
        }
        const int64_t tile = i8 ? MTI : MT;
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            float res[MTI];
            const int mt = M - m0 < tile ? (int)(M - m0) : (int)tile;
#ifdef HAVE_I8_PATH
            if (i8) {
#ifdef HAVE_ZMM_PATH
#define CALL(k) (four ? q4_row_z(row, sh, oh, of, blk, nchunk, &a, m0, Kp, k, res) \
                      : q8_row_z((const int8_t *)row, sh, blk, nchunk, &a, m0, Kp, k, res))
#else
#define CALL(k) (four ? q4_row_i8(row, sc, of, nchunk, gs / CHUNK, &a, m0, Kp, k, res) \
                      : q8_row_i8((const int8_t *)row, sc, nchunk, gs, &a, m0, Kp, k, res))
#endif
                FOR_EACH_MTI(mt, CALL);
#undef CALL
            } else
#endif
            {
                const float *xm = xp + m0 * Kp;
#define CALL(k) (four ? q4_row(row, sc, of, nchunk, gs / CHUNK, xm, Kp, k, res) \
                      : q8_row((const int8_t *)row, sc, Kp, gs, xm, Kp, k, res))
                FOR_EACH_MT(mt, CALL);
#undef CALL
            }
            for (int i = 0; i < mt; i++)
                y[(m0 + i) * ldy + n] = res[i] + (W->bias ? W->bias[n] : 0.f);
        }
    }
#ifdef HAVE_I8_PATH
    if (i8)
        free_activations(a);
#endif
#ifdef HAVE_ZMM_PATH
    free(blk);
#endif
    free(xp);
}

/* Row n of a packed matrix, dequantized into out (K,) fp32: what the prefill path's GEMM reads
 * (wdequant, wdequant_bf16). */
static void q4_dequant_row(const wdesc *W, int64_t n, float *out)
{
    const int64_t K = W->K, gs = W->group_size, G = W->Kp / gs;
    const uint8_t *row = (const uint8_t *)W->w + n * (W->Kp / 2);
    const half *sc = W->scales + n * G;
    const half *of = W->kind == KIND_INT4 && W->offsets ? W->offsets + n * G : NULL;
    const uint8_t *z = W->kind == KIND_INT4Z ? W->zeros + n * G : NULL;
    for (int64_t g = 0; g < G; g++) { /* a group at a time: a loop gcc vectorizes */
        const float s = sc[g], o = z ? -(float)z[g] * s : of ? (float)of[g] : -8.f * s;
        const int64_t j0 = g * gs / 2, j1 = (g + 1) * gs / 2;
        const int64_t full = j1 <= K / 2 ? j1 : K / 2; /* byte pairs inside K */
        for (int64_t j = j0; j < full; j++) {
            out[2 * j] = (float)(row[j] & 15) * s + o;
            out[2 * j + 1] = (float)(row[j] >> 4) * s + o;
        }
        if (full < j1 && 2 * full < K) /* K odd: the last input's low nibble */
            out[2 * full] = (float)(row[full] & 15) * s + o;
    }
}

static void q8_dequant_row(const wdesc *W, int64_t n, float *out)
{
    const int64_t K = W->K, gs = W->group_size, G = W->Kp / gs;
    const int8_t *row = (const int8_t *)W->w + n * W->Kp;
    for (int64_t g = 0; g < G; g++) {
        const float s = (float)W->scales[n * G + g];
        const int64_t k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
        for (int64_t k = g * gs; k < k1; k++)
            out[k] = (float)row[k] * s;
    }
}

/* ---- KV cache ----------------------------------------------------------------------------- */

enum { KV_FP32 = 0, KV_FP16 = 1, KV_BF16 = 2, KV_INT8 = 3, KV_INT4 = 4 };
#define MAX_HEAD_DIM 1024 /* kernels/cpu_ops.py MAX_HEAD_DIM: the stack buffers below */

/* One layer's KV cache: the tensors of kernels/cpu_ops.py KV_TENSORS, in that order, NULL where
 * the kind has none. Shapes, with slot = block * block_size + offset:
 *   k, v                 (num_blocks, block_size, hkv, d): fp32/fp16/bf16/int8, or for int4
 *                        (..., d / 2) uint8 packed codes
 *   k_scale, v_scale     (num_blocks, block_size, hkv) fp16: int8 and int4 (k_scale is t)
 *   v_offset             (num_blocks, block_size, hkv) fp16: int4 only
 *   k_sigma, k_width, k_start   (hkv, d) fp32 / int32 / int32: int4 keys' codebook
 * Python passes it as 8 int64 addresses (KV_TENSORS), so the layout is 8 pointers. */
typedef struct {
    void *k;
    half *k_scale;
    void *v;
    half *v_scale, *v_offset;
    const float *k_sigma;
    const int32_t *k_width, *k_start;
} kv_layer;
_Static_assert(sizeof(kv_layer) == 8 * sizeof(int64_t), "kv_layer is 8 int64 addresses");

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) /* round to nearest even, as torch does */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000)
        return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* In-place x <- x H for the orthonormal Hadamard matrix of kernels/kv_quant.py: butterflies
 * within blocks of n = the largest power of two dividing d, in the reference's order (so the
 * result is bit-identical), then the 1/sqrt(n) factor. */
static void hadamard(float *x, int d)
{
    const int n = d & -d;
    const float norm = (float)(1.0 / sqrt((double)n));
    for (int base = 0; base < d; base += n) {
        float *y = x + base;
        for (int h = 1; h < n; h *= 2)
            for (int i = 0; i < n; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        for (int j = 0; j < n; j++)
            y[j] *= norm;
    }
}

/* Read one (slot, head) vector of a cache into f[d] fp32, for every kind but int4 keys
 * (key4_load): int8 and int4 vectors are still Hadamard-rotated (attention works in the
 * rotated basis). int4 here is values: 4-bit codes, element 2j in the low nibble of byte j,
 * x = code * scale + offset. */
static inline void kv_load(int kind, const void *vals, const half *scale, const half *offset,
                           int64_t idx, int d, float *f)
{
    switch (kind) {
    case KV_FP32:
        memcpy(f, (const float *)vals + idx * d, sizeof(float) * d);
        break;
    case KV_FP16: {
        const half *p = (const half *)vals + idx * d;
        for (int j = 0; j < d; j++)
            f[j] = (float)p[j];
        break;
    }
    case KV_BF16: {
        const uint16_t *p = (const uint16_t *)vals + idx * d;
        for (int j = 0; j < d; j++)
            f[j] = bf16_to_f32(p[j]);
        break;
    }
    case KV_INT8: {
        const int8_t *p = (const int8_t *)vals + idx * d;
        const float s = (float)scale[idx];
        for (int j = 0; j < d; j++)
            f[j] = (float)p[j] * s;
        break;
    }
    default: {
        const uint8_t *p = (const uint8_t *)vals + idx * (d / 2);
        const float s = (float)scale[idx], o = (float)offset[idx];
        for (int j = 0; j < d; j++)
            f[j] = (float)((p[j / 2] >> (j % 2 * 4)) & 15) * s + o;
    }
    }
}

/* Quantize and store one vector x[d] (fp32) at index idx = slot * hkv + head, as
 * kernels/kv_quant.py quantize() does, bit for bit, for every kind but int4 keys (key4_store).
 * x is clobbered. */
static void kv_store(int kind, void *vals, half *scale, half *offset, int64_t idx, int d,
                     float *x)
{
    const float tiny = 6.103515625e-05f; /* 2^-14 */
    switch (kind) {
    case KV_FP32:
        memcpy((float *)vals + idx * d, x, sizeof(float) * d);
        return;
    case KV_FP16: {
        half *p = (half *)vals + idx * d;
        for (int j = 0; j < d; j++)
            p[j] = (half)x[j];
        return;
    }
    case KV_BF16: {
        uint16_t *p = (uint16_t *)vals + idx * d;
        for (int j = 0; j < d; j++)
            p[j] = f32_to_bf16(x[j]);
        return;
    }
    case KV_INT8: {
        hadamard(x, d);
        float amax = 0.f;
        for (int j = 0; j < d; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        const half sh = (half)fmaxf(amax / 127.f, tiny);
        const float s = (float)sh;
        int8_t *p = (int8_t *)vals + idx * d;
        for (int j = 0; j < d; j++)
            p[j] = (int8_t)fminf(fmaxf(nearbyintf(x[j] / s), -127.f), 127.f);
        scale[idx] = sh;
        return;
    }
    default: { /* int4 values: kv_quant.quantize_packed(H x, 4) */
        hadamard(x, d);
        float lo = x[0], hi = x[0];
        for (int j = 1; j < d; j++) {
            lo = x[j] < lo ? x[j] : lo;
            hi = x[j] > hi ? x[j] : hi;
        }
        /* each range cut of kv_quant.CLIP_DIVISORS, keeping the least squared error (fp64:
         * every residual is exact there, so the choice is the reference's) */
        static const float divisors[] = {0.f, 40.f, 20.f, 14.f, 10.f, 8.f, 7.f};
        const float levels = 15.f;
        float q[MAX_HEAD_DIM], best[MAX_HEAD_DIM]; /* codes as floats: the loops vectorize */
        double best_err = INFINITY;
        half best_s = 0, best_o = 0;
        for (int c = 0; c < (int)(sizeof divisors / sizeof divisors[0]); c++) {
            const float cut = divisors[c] > 0.f ? (hi - lo) / divisors[c] : 0.f;
            const half oh = (half)(lo + cut);
            const float o = (float)oh;
            const half sh = (half)fmaxf((hi - cut - o) / levels, tiny);
            const float s = (float)sh;
            for (int j = 0; j < d; j++) {
                const float v = nearbyintf((x[j] - o) / s);
                q[j] = v > 0.f ? (v < levels ? v : levels) : 0.f;
            }
            double acc[8] = {0.0}; /* 8 partial sums (d % 8 == 0), 2 vectors of 4 */
            for (int j = 0; j < d; j += 8)
                for (int u = 0; u < 8; u++) {
                    const double r = (double)q[j + u] * s + o - x[j + u];
                    acc[u] += r * r;
                }
            double err = 0.0;
            for (int u = 0; u < 8; u++)
                err += acc[u];
            if (err < best_err) {
                best_err = err;
                memcpy(best, q, sizeof(float) * (size_t)d);
                best_s = sh;
                best_o = oh;
            }
        }
        uint8_t *p = (uint8_t *)vals + idx * (d / 2);
        for (int j = 0; j < d; j += 2)
            p[j / 2] = (uint8_t)((int)best[j] | (int)best[j + 1] << 4);
        scale[idx] = best_s;
        offset[idx] = best_o;
    }
    }
}

/* int4 keys through the head's codebook (sigma, width: d each), as kv_quant.quantize_keys,
 * bit for bit:
 *     z_j = x_j / sigma_j      t = fp16(clamp(max |z_j| over b_j > 0, 2^-14, 65504))
 *     code_j = floor((z_j + t) / (t / 2^(b_j - 1)))  clamped to [0, 2^b_j - 1]
 * Each step is one IEEE operation as in the reference (divisions: nothing a compiler could
 * fuse into an FMA). Codes go to p[d / 2] as a little-endian bit stream, channel after
 * channel, low bit first: channel j starts at bit sum_{i<j} b_i, its k_start. */
static void key4_store(const float *x, const float *sigma, const int32_t *width, int d,
                       uint8_t *p, half *t_out)
{
    float z[MAX_HEAD_DIM];
    uint8_t code[MAX_HEAD_DIM];
    float zmax = 0.f;
    for (int j = 0; j < d; j++) {
        z[j] = x[j] / sigma[j];
        const float a = fabsf(z[j]);
        zmax = width[j] > 0 && a > zmax ? a : zmax;
    }
    const half th = (half)fminf(fmaxf(zmax, 6.103515625e-05f), 65504.f);
    const float t = (float)th;
    for (int j = 0; j < d; j++) {
        /* half_j = 2^(b_j - 1), a power of two, so t / half_j is exact; b_j = 0 gives
         * t / 0 = inf and code 0, never stored */
        const float half_j = (float)((1 << width[j]) >> 1), top = (float)((1 << width[j]) - 1);
        const float c = floorf((z[j] + t) / (t / half_j));
        code[j] = (uint8_t)(c > 0.f ? (c < top ? c : top) : 0.f); /* NaN -> 0 */
    }
    uint32_t bits = 0; /* pending bits, the oldest lowest: at most 7 + 8 */
    int nbits = 0;
    for (int j = 0; j < d; j++) {
        bits |= (uint32_t)code[j] << nbits;
        for (nbits += width[j]; nbits >= 8; nbits -= 8, bits >>= 8)
            *p++ = (uint8_t)bits;
    }
    /* the widths sum to 4 d bits: exactly d / 2 bytes written, nothing left pending */
    *t_out = th;
}

/* Write T tokens' K and V (T, hkv, d) fp32 into their slots. Parallel over (token, head)
 * once there are enough to pay for waking the threads (one takes ~2 us at d = 64). */
void kv_write(int kind, const float *k, const float *v, const int64_t *slots, int64_t T,
              int64_t hkv, int d, const kv_layer *c, int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * hkv >= 16)
    for (int64_t i = 0; i < T * hkv; i++) {
        const int64_t h = i % hkv, src = i * d, idx = slots[i / hkv] * hkv + h;
        float buf[MAX_HEAD_DIM];
        if (kind == KV_INT4) {
            key4_store(k + src, c->k_sigma + h * d, c->k_width + h * d, d,
                       (uint8_t *)c->k + idx * (d / 2), c->k_scale + idx);
        } else {
            memcpy(buf, k + src, sizeof(float) * d);
            kv_store(kind, c->k, c->k_scale, NULL, idx, d, buf);
        }
        memcpy(buf, v + src, sizeof(float) * d);
        kv_store(kind, c->v, c->v_scale, c->v_offset, idx, d, buf);
    }
}

/* a . b with 8 independent partial sums, so the compiler keeps them in one vector register
 * instead of waiting on one serial chain of fma latencies */
static inline float dot(const float *a, const float *b, int d)
{
    float acc[8] = {0};
    int j = 0;
    for (; j + 8 <= d; j += 8)
        for (int u = 0; u < 8; u++)
            acc[u] += a[j + u] * b[j + u];
    float s = 0.f;
    for (; j < d; j++)
        s += a[j] * b[j];
    for (int u = 0; u < 8; u++)
        s += acc[u];
    return s;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_ATT_SIMD 1

/* e^x: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (truncation
 * < 2e-7 relative), times 2^n built in the exponent field. x is clamped to [-87, 88]: below,
 * it returns ~1e-38 instead of 0; above, ~1.7e38 instead of inf (silu's g / (1 + e^-g) is then
 * ~0 either way). */
static inline __m256 exp_ps(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2, split in two */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The 8 dot products of q[d] with rows k[0..8) (each d long), d % 8 == 0: one accumulator
 * per row, then a transposing horizontal-add tree. */
static inline __m256 dots8(const float *q, const float *const *k, int d)
{
    __m256 a[8];
    for (int r = 0; r < 8; r++)
        a[r] = _mm256_setzero_ps();
    for (int j = 0; j < d; j += 8) {
        const __m256 qv = _mm256_loadu_ps(q + j);
        for (int r = 0; r < 8; r++)
            a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[r] + j), a[r]);
    }
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    /* s0's low lane holds rows 0-3 over elements 0-3 of each 8, its high lane over 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                         _mm256_permute2f128_ps(s0, s1, 0x31));
}
#endif

/* int4 keys as the readers want a layer's codebook: per kv head, d / 8 groups of 8 channels.
 * Channel j's code lies in the 4 bytes from base_j = min(start_j / 8, d / 2 - 4) (clamped, so
 * the 4-byte read never leaves the vector), at bit shift_j = start_j - 8 base_j under
 * mask_j = 2^b_j - 1 (shift_j + b_j <= 32). A group's 8 channels start within 56 bits of each
 * other, so their 4-byte windows lie within the 16 bytes from
 * gbase = max(0, min(start of its first channel / 8, d / 2 - 16)): one 16-byte load and one
 * byte shuffle bring every channel's 4 bytes into its lane. The key is then
 *     x_j = t (alpha_j code_j + beta_j),  alpha_j = sigma_j / half_j,
 *     beta_j = sigma_j (0.5 / half_j - 1),  half_j = 2^(b_j - 1)   (0 and 0 for b_j = 0):
 * kv_quant.dequantize_keys' sigma_j ((code_j + 1/2) t / half_j - t), regrouped. */
typedef struct {
    uint8_t shuf[32]; /* lane i's 4 bytes are bytes shuf[4i] .. shuf[4i] + 3 from gbase */
    int32_t shift[8], mask[8];
    float alpha[8], beta[8];
    int32_t gbase;
} __attribute__((aligned(32))) key4_group;

/* (hkv, d / 8) groups for the codebook (sigma, width, start: (hkv, d) each); free() it. */
static key4_group *key4_groups(const float *sigma, const int32_t *width, const int32_t *start,
                               int64_t hkv, int d)
{
    const int nbytes = d / 2, ng = d / 8;
    key4_group *groups = aligned_alloc(32, sizeof(key4_group) * (size_t)(hkv * ng));
    for (int64_t gi = 0; gi < hkv * ng; gi++) {
        key4_group *G = groups + gi;
        const int64_t j0 = gi * 8; /* (hkv, d) index of the group's first channel */
        const int first = start[j0] / 8 < nbytes - 16 ? start[j0] / 8 : nbytes - 16;
        G->gbase = first > 0 ? first : 0;
        for (int i = 0; i < 8; i++) {
            const int b = width[j0 + i], s = start[j0 + i];
            const int base = s / 8 < nbytes - 4 ? s / 8 : nbytes - 4;
            for (int u = 0; u < 4; u++)
                G->shuf[4 * i + u] = (uint8_t)(base - G->gbase + u);
            G->shift[i] = b ? s - 8 * base : 0; /* b = 0 may start at bit 4 d: no shift by 32 */
            G->mask[i] = (1 << b) - 1;
            const float half_j = (float)(1 << b) / 2.f, sg = sigma[j0 + i];
            G->alpha[i] = b ? sg / half_j : 0.f;
            G->beta[i] = b ? sg * (0.5f / half_j - 1.f) : 0.f;
        }
    }
    return groups;
}

/* Key idx = slot * hkv + head of an int4 cache into f[d] fp32; G: that head's d / 8 groups. */
static inline void key4_load(const key4_group *G, const uint8_t *vals, const half *scale,
                             int64_t idx, int d, float *f)
{
    const uint8_t *p = vals + idx * (d / 2);
    const float t = (float)scale[idx];
    for (int j = 0; j < d; j++) {
        const key4_group *g = G + j / 8;
        const int i = j % 8;
        const uint8_t *w = p + g->gbase + g->shuf[4 * i];
        const uint32_t word = w[0] | (uint32_t)w[1] << 8 | (uint32_t)w[2] << 16 |
                              (uint32_t)w[3] << 24;
        const float code = (float)((word >> g->shift[i]) & (uint32_t)g->mask[i]);
        f[j] = t * (g->alpha[i] * code + g->beta[i]);
    }
}

#ifdef HAVE_ATT_SIMD
/* key4_load, 8 channels a step: broadcast the group's 16 bytes to both 128-bit lanes (a byte
 * shuffle stays within its lane), shuffle each channel's 4 bytes into its 32-bit lane, shift,
 * mask, scale. Needs d >= 32 (16 bytes to load). */
static inline void key4_load_simd(const key4_group *G, const uint8_t *vals, const half *scale,
                                  int64_t idx, int d, float *f)
{
    const uint8_t *p = vals + idx * (d / 2);
    const __m256 t = _mm256_set1_ps((float)scale[idx]);
    for (int j = 0; j < d; j += 8, G++) {
        const __m256i bytes = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(p + G->gbase)));
        __m256i code = _mm256_shuffle_epi8(bytes, _mm256_load_si256((const __m256i *)G->shuf));
        code = _mm256_srlv_epi32(code, _mm256_load_si256((const __m256i *)G->shift));
        code = _mm256_and_si256(code, _mm256_load_si256((const __m256i *)G->mask));
        const __m256 x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), _mm256_load_ps(G->alpha),
                                         _mm256_load_ps(G->beta));
        _mm256_storeu_ps(f + j, _mm256_mul_ps(x, t));
    }
}
#endif

static inline void key4_load_fast(const key4_group *G, const uint8_t *vals, const half *scale,
                                  int64_t idx, int d, float *f)
{
#ifdef HAVE_ATT_SIMD
    if (d >= 32) {
        key4_load_simd(G, vals, scale, idx, d, f);
        return;
    }
#endif
    key4_load(G, vals, scale, idx, d, f);
}

/* kv_load, vectorized where the layout allows (d % 8 == 0). */
static inline void kv_load_fast(int kind, const void *vals, const half *scale,
                                const half *offset, int64_t idx, int d, float *f)
{
#ifdef HAVE_ATT_SIMD
    if (d % 8 == 0) {
        switch (kind) {
        case KV_FP32:
            memcpy(f, (const float *)vals + idx * d, sizeof(float) * d);
            return;
        case KV_FP16: {
            const half *p = (const half *)vals + idx * d;
            for (int j = 0; j < d; j += 8)
                _mm256_storeu_ps(f + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + j))));
            return;
        }
        case KV_BF16: {
            const uint16_t *p = (const uint16_t *)vals + idx * d;
            for (int j = 0; j < d; j += 8) {
                const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + j)));
                _mm256_storeu_ps(f + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
            return;
        }
        case KV_INT8: {
            const int8_t *p = (const int8_t *)vals + idx * d;
            const __m256 s = _mm256_set1_ps((float)scale[idx]);
            for (int j = 0; j < d; j += 8)
                _mm256_storeu_ps(f + j, _mm256_mul_ps(i8_to_ps(_mm_loadl_epi64((const __m128i *)(p + j))), s));
            return;
        }
        default: { /* int4 values: 8 codes are 4 bytes, broadcast to 8 lanes, lane i >> 4 i */
            const uint8_t *p = (const uint8_t *)vals + idx * (d / 2);
            const __m256 s = _mm256_set1_ps((float)scale[idx]), o = _mm256_set1_ps((float)offset[idx]);
            const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            const __m256i mask = _mm256_set1_epi32(15);
            for (int j = 0; j < d; j += 8) {
                int32_t word;
                memcpy(&word, p + j / 2, 4);
                const __m256i q =
                    _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shift), mask);
                _mm256_storeu_ps(f + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, o));
            }
            return;
        }
        }
    }
#endif
    kv_load(kind, vals, scale, offset, idx, d, f);
}

/* s[t] = scale * q . k[t] for n rows k[t] (d floats each); returns the largest s[t] */
static float att_scores(const float *q, const float *const *k, int64_t n, int d, float scale,
                        float *s)
{
    int64_t t = 0;
    float mx = -INFINITY;
#ifdef HAVE_ATT_SIMD
    if (d % 8 == 0 && n >= 8) {
        __m256 vm = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= n; t += 8) {
            const __m256 v = _mm256_mul_ps(dots8(q, k + t, d), _mm256_set1_ps(scale));
            _mm256_storeu_ps(s + t, v);
            vm = _mm256_max_ps(vm, v);
        }
        mx = hmax(vm);
    }
#endif
    for (; t < n; t++) {
        s[t] = dot(q, k[t], d) * scale;
        mx = s[t] > mx ? s[t] : mx;
    }
    return mx;
}

/* s[t] <- exp(s[t] - m) in place for n scores; returns the sum of the new s */
static float att_exp(float *s, int64_t n, float m)
{
    float total = 0.f;
    int64_t t = 0;
#ifdef HAVE_ATT_SIMD
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = hsum(acc);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        total += s[t];
    }
    return total;
}

/* acc[d] <- alpha acc + sum_t p[t] v[t] for n rows v[t] (d floats each) */
static void att_weighted_sum(const float *p, const float *const *v, int64_t n, int d,
                             float alpha, float *acc)
{
    int j0 = 0;
#ifdef HAVE_ATT_SIMD
    const __m256 al = _mm256_set1_ps(alpha);
    for (; j0 + 64 <= d; j0 += 64) { /* 64 columns in 8 registers: 8 fma chains in flight */
        __m256 a[8];
        for (int u = 0; u < 8; u++)
            a[u] = _mm256_mul_ps(al, _mm256_loadu_ps(acc + j0 + 8 * u));
        for (int64_t t = 0; t < n; t++) {
            const __m256 w = _mm256_broadcast_ss(p + t);
            for (int u = 0; u < 8; u++)
                a[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[t] + j0 + 8 * u), a[u]);
        }
        for (int u = 0; u < 8; u++)
            _mm256_storeu_ps(acc + j0 + 8 * u, a[u]);
    }
    for (; j0 + 8 <= d; j0 += 8) {
        __m256 a = _mm256_mul_ps(al, _mm256_loadu_ps(acc + j0));
        for (int64_t t = 0; t < n; t++)
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(p + t), _mm256_loadu_ps(v[t] + j0), a);
        _mm256_storeu_ps(acc + j0, a);
    }
#endif
    for (int j = j0; j < d; j++) {
        float a = alpha * acc[j];
        for (int64_t t = 0; t < n; t++)
            a += p[t] * v[t][j];
        acc[j] = a;
    }
}

/* Context positions per decode-attention task, at most. A sequence's cut depends on its own
 * length alone (att_part_len), so its result, bit for bit, never depends on what else is in
 * the batch. */
#define ATT_PART 128
/* Positions a task converts to fp32 at a time (its steps; fixed for the same reason) */
#define ATT_STEP 16

/* Positions a part of a context of n positions holds, cut into `parts` = ceil(n / ATT_PART)
 * parts: as even as whole steps allow (at most ATT_PART), the last part the rest. A context of
 * 129-256 positions is two near-equal tasks for two threads rather than 128 and 1-128: 16
 * layers of fp16 K/V, caches evicted between layers, at 140 / 192 / 250 positions 1.03-1.07 /
 * 1.05-1.09 / 1.06-1.13 ms -> 0.71-0.90 / 0.83-0.97 / 1.10-1.17; 1B Q4_K_M batch-1 attention,
 * 129-256 positions, 0.86-0.88 -> 0.80-0.84 ms a step (Zen 4, 2 threads, runs alternated). */
static inline int64_t att_part_len(int64_t n, int64_t parts)
{
    const int64_t even = (n + parts - 1) / parts;
    return (even + ATT_STEP - 1) / ATT_STEP * ATT_STEP;
}

/* Decode attention: one query per sequence against its paged context.
 *   q (B, H, d) fp32; out (B, H, d) fp32; tables (B, max_blocks); seq_lens (B,); c: the
 *   layer's cache (kv_layer); sinks (H,) or NULL: each head's sink logit, a softmax term
 *   with a zero value (gpt-oss), merged with the parts.
 * FlashDecoding-style: each task is one part of one sequence's context (att_part_len) and hg
 * of its kv heads: all hkv where the batch has parts enough to keep every thread busy (a position's
 * whole slot, so a block's rows are read in order), fewer where not (one short sequence still
 * gives each thread tasks). A task walks its positions ATT_STEP at a time: it converts those
 * positions' K and V rows of its kv heads to fp32 once, into a buffer that stays in L1/L2, for
 * the g = H / hkv query heads that share each, and keeps per query head the running max score
 * m, the sum l of exp(score - m) and the exp-weighted sum of values, rescaled as m grows
 * (online softmax); a second pass merges a sequence's parts in order. Converting a whole part
 * first (hg x 128 rows of fp32, 512 KiB for 8 heads of 64) wrote and read back twice the
 * cache's bytes through memory: 16 layers at 250 positions, caches evicted between layers
 * (Zen 4, 2 threads, fp16 K/V), 1.20-1.36 against 1.05-1.17 ms. int8 K and V and int4 V hold
 * y = H x (int4 keys are not rotated: their codebook works on raw channels), and H is
 * symmetric orthonormal, so q . x = (H q) . y and sum p x = H (sum p y): rotate the queries
 * (int8) and the output (int8, int4), never the context. */
void paged_decode(int kind, const float *q, float *out, int64_t B, int64_t H, int64_t hkv, int d,
                  const kv_layer *c, const int64_t *tables, int64_t max_blocks,
                  const int64_t *seq_lens, int64_t block_size, float scale, int64_t window,
                  const float *sinks, int nthreads)
{
    const int64_t g = H / hkv;
    const int rotate_q = kind == KV_INT8, rotate_out = kind == KV_INT8 || kind == KV_INT4;
    key4_group *book = kind == KV_INT4 ? key4_groups(c->k_sigma, c->k_width, c->k_start, hkv, d)
                                       : NULL;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first part of sequence b */
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_lens[b], start = window > 0 && L > window ? L - window : 0;
        first[b + 1] = first[b] + (L > start ? (L - start + ATT_PART - 1) / ATT_PART : 1);
    }
    const int64_t ntasks = first[B];
    /* kv heads a task: all of them where there are parts enough for the threads, else the
     * largest divisor of hkv that gives each thread a task (1 at least: SmolLM2's 3 kv heads,
     * one sequence under 129 positions, are 3 tasks). Whole slots at two parts for two
     * threads (128 positions and fewer) read faster than half slots in four tasks: 1B Q4_K_M
     * at batch 1, 128-176 positions, +2.4% (Zen 4, one engine alternating builds). */
    int64_t hg = hkv;
    while (hg > 1 && ntasks * (hkv / hg) < (int64_t)nthreads)
        do
            hg--;
        while (hkv % hg);
    const int64_t ngroups = hkv / hg;
    /* per (part, query head): m, l and the weighted sum of values */
    float *pacc = malloc(sizeof(float) * (size_t)(ntasks * H * d));
    float *pm = malloc(sizeof(float) * (size_t)(ntasks * H));
    float *pl = malloc(sizeof(float) * (size_t)(ntasks * H));
    float *qrot = rotate_q ? malloc(sizeof(float) * (size_t)(B * H * d)) : NULL; /* H q */
#pragma omp parallel num_threads(nthreads)
    {
        /* (hg, ATT_STEP, d): a step's rows of the task's kv heads */
        float *kf = malloc(sizeof(float) * (size_t)(hg * ATT_STEP * d));
        float *vf = malloc(sizeof(float) * (size_t)(hg * ATT_STEP * d));
        float s[ATT_STEP];
        /* the rows a step reads: kf / vf's, or fp32 cache rows where they lie */
        const float **krow = malloc(sizeof(float *) * (size_t)(hg * ATT_STEP));
        const float **vrow = malloc(sizeof(float *) * (size_t)(hg * ATT_STEP));
        for (int64_t t = 0; t < hg * ATT_STEP; t++) {
            krow[t] = kf + t * d;
            vrow[t] = vf + t * d;
        }
        if (rotate_q) { /* each query rotated once, not once per part */
#pragma omp for schedule(static)
            for (int64_t bq = 0; bq < B * H; bq++) {
                memcpy(qrot + bq * d, q + bq * d, sizeof(float) * d);
                hadamard(qrot + bq * d, d);
            }
        }
        /* a task is one part and hg kv heads: their K/V rows are read once for each head's g
         * query heads, a position's hg heads side by side (whole slots where hg = hkv, so a
         * block's rows are read in order), and a batch-1 step still has hkv / hg tasks per
         * part to spread over the threads */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntasks * ngroups; task++) {
            const int64_t part = task / ngroups, h0 = task % ngroups * hg;
            int64_t lo = 0, hi = B; /* the sequence b with first[b] <= part < first[b + 1] */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first[mid] <= part)
                    lo = mid;
                else
                    hi = mid;
            }
            const int64_t b = lo, L = seq_lens[b];
            const int64_t start = window > 0 && L > window ? L - window : 0;
            const int64_t len = att_part_len(L - start, first[b + 1] - first[b]);
            const int64_t t0 = start + (part - first[b]) * len;
            const int64_t n = L - t0 < len ? L - t0 : len; /* 0: an empty context */
            const int64_t *table = tables + b * max_blocks;
            const float *qb = rotate_q ? qrot : q;
            for (int64_t qh = h0 * g; qh < (h0 + hg) * g; qh++) { /* an empty context: nothing */
                const int64_t r = part * H + qh;
                pm[r] = -INFINITY;
                pl[r] = 0.f;
                memset(pacc + r * d, 0, sizeof(float) * d);
            }
            for (int64_t t1 = 0; t1 < n; t1 += ATT_STEP) {
                const int64_t m = n - t1 < ATT_STEP ? n - t1 : ATT_STEP;
                for (int64_t t = 0; t < m; t++) {
                    const int64_t pos = t0 + t1 + t;
                    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                    for (int64_t j = 0; j < hg; j++) {
                        const int64_t h = h0 + j, idx = slot * hkv + h, row = j * ATT_STEP + t;
                        if (kind == KV_FP32) { /* read in place: a copy cost as much as the reads */
                            krow[row] = (const float *)c->k + idx * d;
                            vrow[row] = (const float *)c->v + idx * d;
                            continue;
                        }
                        if (kind == KV_INT4)
                            key4_load_fast(book + h * (d / 8), c->k, c->k_scale, idx, d,
                                           kf + row * d);
                        else
                            kv_load_fast(kind, c->k, c->k_scale, NULL, idx, d, kf + row * d);
                        kv_load_fast(kind, c->v, c->v_scale, c->v_offset, idx, d, vf + row * d);
                    }
                }
                for (int64_t j = 0; j < hg; j++)
                    for (int64_t qh = (h0 + j) * g; qh < (h0 + j + 1) * g; qh++) {
                        const int64_t r = part * H + qh;
                        const float top = att_scores(qb + (b * H + qh) * d, krow + j * ATT_STEP,
                                                     m, d, scale, s);
                        const float mx = top > pm[r] ? top : pm[r];
                        /* the terms so far, rescaled to the new max (none at the first step) */
                        const float alpha = pm[r] == mx ? 1.f
                                            : pm[r] == -INFINITY ? 0.f : expf(pm[r] - mx);
                        pl[r] = alpha * pl[r] + att_exp(s, m, mx);
                        pm[r] = mx;
                        att_weighted_sum(s, vrow + j * ATT_STEP, m, d, alpha, pacc + r * d);
                    }
            }
        }
        /* (implicit barrier) merge each sequence's parts, in order */
#pragma omp for schedule(static)
        for (int64_t bq = 0; bq < B * H; bq++) {
            const int64_t b = bq / H, qh = bq % H;
            float mx = sinks ? sinks[qh] : -INFINITY;
            for (int64_t p = first[b]; p < first[b + 1]; p++)
                mx = fmaxf(mx, pm[p * H + qh]);
            /* a sink is one more term of the softmax, with a zero value: its exp joins l */
            float l = sinks ? expf(sinks[qh] - mx) : 0.f;
            float *o = out + bq * d;
            memset(o, 0, sizeof(float) * d);
            for (int64_t p = first[b]; p < first[b + 1]; p++) {
                const int64_t r = p * H + qh;
                if (pl[r] == 0.f)
                    continue;
                const float w = expf(pm[r] - mx);
                l += w * pl[r];
                for (int j = 0; j < d; j++)
                    o[j] += w * pacc[r * d + j];
            }
            const float inv = l > 0.f ? 1.f / l : 0.f;
            for (int j = 0; j < d; j++)
                o[j] *= inv;
            if (rotate_out)
                hadamard(o, d);
        }
        free(kf);
        free(vf);
        free(krow);
        free(vrow);
    }
    free(qrot);
    free(book);
    free(first);
    free(pacc);
    free(pm);
    free(pl);
}

/* Dense fp32: y = x W^T (+ bias), W (N, K) row-major. */
void f32_matmul(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N,
                const float *bias, float *y, int64_t ldy, int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, ROW_ITEM)
    for (int64_t nb = 0; nb < (N + NR - 1) / NR; nb++) { /* NR weight rows, the last N % NR */
        const int64_t n = nb * NR;
        const int nr = N - n < NR ? (int)(N - n) : NR;
        for (int64_t m = 0; m < M; m++) {
            float res[NR];
            switch (nr) {
            case 1: f32_rows(w + n * K, K, x + m * ldx, 1, res); break;
            case 2: f32_rows(w + n * K, K, x + m * ldx, 2, res); break;
            case 3: f32_rows(w + n * K, K, x + m * ldx, 3, res); break;
            default: f32_rows(w + n * K, K, x + m * ldx, NR, res);
            }
            for (int r = 0; r < nr; r++)
                y[m * ldy + n + r] = res[r] + (bias ? bias[n + r] : 0.f);
        }
    }
}

#include "cpu_formats.c"

/* ---- one entry for every weight kind ---------------------------------------------------------
 * y (M, N), row stride ldy, = x (M, K), row stride ldx, times W^T (+ W's bias). i8: quantize the
 * activations to int8 (int4/int8/GGML kinds; dense kinds keep fp32). Returns 0, or -1 for a kind
 * this build does not know. */
int gemm_min_rows(const wdesc *W);
int wgemm_i8(const wdesc *W, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
             int nthreads);

int wmatmul(const wdesc *W, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy, int i8,
            int nthreads)
{
    if (i8) { /* decode batches of many rows: the int8 GEMM */
        const int rows = gemm_min_rows(W);
        if (rows > 0 && M >= rows && wgemm_i8(W, x, M, ldx, y, ldy, nthreads) == 0)
            return 0;
    }
    switch (W->kind) {
    case KIND_F32:
        f32_matmul(x, M, W->K, ldx, W->w, W->N, W->bias, y, ldy, nthreads);
        return 0;
    case KIND_INT4:
    case KIND_INT4Z:
    case KIND_INT8:
        packed_matmul(W, x, M, ldx, y, ldy, i8, nthreads);
        return 0;
    case KIND_F16:
    case KIND_BF16:
        half_matmul(W, x, M, ldx, y, ldy, nthreads);
        return 0;
#ifdef HAVE_I8_PATH
    case KIND_Q4_K_X16:
    case KIND_Q6_K_X16:
    case KIND_INT4_X16:
        x16_matmul(W, x, M, ldx, y, ldy, i8, nthreads);
        return 0;
#endif
    default: {
        const ggml_type *t = ggml_type_of(W->kind);
        if (!t)
            return -1;
        ggml_matmul(t, W, x, M, ldx, y, ldy, i8, nthreads);
        return 0;
    }
    }
}

int wkind_known(int64_t kind);

/* Row n of W into out (K,) fp32; 0, or -1 for a kind this build does not know. */
static int dequant_row(const wdesc *W, int64_t n, float *out)
{
    switch (W->kind) {
    case KIND_F32:
        memcpy(out, (const float *)W->w + n * W->K, sizeof(float) * (size_t)W->K);
        return 0;
    case KIND_INT4:
    case KIND_INT4Z:
        q4_dequant_row(W, n, out);
        return 0;
    case KIND_INT8:
        q8_dequant_row(W, n, out);
        return 0;
    case KIND_F16:
    case KIND_BF16:
        half_dequant_row(W, n, out);
        return 0;
#ifdef HAVE_I8_PATH
    case KIND_Q4_K_X16:
    case KIND_Q6_K_X16:
    case KIND_INT4_X16:
        x16_any_dequant_row(W, n, out);
        return 0;
#endif
    default: {
        const ggml_type *t = ggml_type_of(W->kind);
        if (!t)
            return -1;
        ggml_dequant_row(t, W, n, out);
        return 0;
    }
    }
}

/* out (N, K) fp32 = W, for the prefill path (many rows: dequantize once, then one dense GEMM).
 * Returns 0, or -1 for an unknown kind. */
int wdequant(const wdesc *W, float *out, int nthreads)
{
    if (!wkind_known(W->kind))
        return -1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, ROW_ITEM)
    for (int64_t n = 0; n < W->N; n++)
        dequant_row(W, n, out + n * W->K);
    return 0;
}

/* out (n, K) fp32 = rows rows[0 .. n) of W: a token embedding's lookup, through the same row
 * decoders (the reference's weights exactly). 0, -1 for a kind this build does not know, -2
 * for a row outside W (nothing written). */
int wdequant_rows(const wdesc *W, const int64_t *rows, int64_t n, float *out, int nthreads)
{
    if (!wkind_known(W->kind))
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= W->N)
            return -2;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, ROW_ITEM) if (n >= 64)
    for (int64_t i = 0; i < n; i++)
        dequant_row(W, rows[i], out + i * W->K);
    return 0;
}

/* out (N, K) bf16 = W, rounded to nearest even as torch rounds: the prefill path's GEMM in bf16
 * where the CPU multiplies bf16 fast (AMX / AVX512-BF16 through torch's oneDNN). Each row is
 * dequantized in fp32 into a thread's buffer in L1/L2, so memory sees only the bf16 copy. */
int wdequant_bf16(const wdesc *W, uint16_t *out, int nthreads)
{
    if (!wkind_known(W->kind))
        return -1;
#pragma omp parallel num_threads(nthreads)
    {
        float *row = malloc(sizeof(float) * (size_t)(W->K + 16));
#pragma omp for schedule(dynamic, ROW_ITEM)
        for (int64_t n = 0; n < W->N; n++) {
            dequant_row(W, n, row);
            uint16_t *o = out + n * W->K;
            int64_t k = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
            for (; k + 16 <= W->K; k += 16)
                _mm256_storeu_si256((__m256i *)(o + k),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
#endif
            for (; k < W->K; k++)
                o[k] = f32_to_bf16(row[k]);
        }
        free(row);
    }
    return 0;
}

#ifdef HAVE_I8_PATH
/* ---- the int8 GEMM (AVX-512 VNNI, or AVX2): prefill without AMX, and decode batches ----------
 * y (M, N) = x W^T on the weights' own integer codes, for M of at least gemm_min_rows:
 *   x: per row m and chunk c (32 inputs), q_x = rne(x * 127 / amax), d_x = amax / 127
 *      (quantize_activations, as for the row kernels); S_x,h the sum of the q_x of half h
 *   W: per row n and 16 inputs h, its format's codes u (unsigned bytes), scale s, offset o and
 *      zero point z, w = s (u - z) + o exactly (gemm_codes_row: the block codes of
 *      kernels/cpu_formats.c, int4 / int8 here), so no weight is rounded a second time
 *   y[m, n] = sum_c,h  d_x s (sum_{i in h} u q_x - z S_x,h)  +  o d_x S_x,h
 * The integer sums are exact (int32). A thread takes GT weight rows at a time (16: a zmm's
 * lanes; AVX2 8: a ymm's) and lays their codes out in its own buffer (in L1/L2, so memory sees
 * only the weights' own reads), one vector per 4 inputs:
 *
 *   tile[c][j]:  lane r (4 bytes) = row n0 + r, inputs 32c + 4j .. 32c + 4j + 3
 *
 * so one vpdpbusd with 4 activation bytes broadcast adds 4 products into each of the GT rows'
 * lanes, and 8 of them are a chunk's exact integer dot for GT rows (4 a half for the types with
 * a scale per 16 inputs), converted and scaled once: 8 vpdpbusd per 3-4 float ops (6-8 with two
 * halves), where the row kernels spend ~3 float ops per vpdpbusd. AVX2 has no vpdpbusd (AVX-VNNI
 * has it on ymm: GEMM_VNNI below, which takes the AVX2 GEMM's tiles and passes as they are): a
 * vpmaddubsw adds pairs of products into int16 lanes, `run` of those are summed in int16 (exact
 * while run * 2 * umax * 127 < 2^15: 8 for 4-bit codes, 2 for 6-bit) and one vpmaddwd against
 * ones widens them into the int32 sums; 8-bit codes (int8's, the iq4 tables': up to 255) would
 * saturate a pair, so the AVX2 GEMM splits them, u = 16 hi + lo, into two 4-bit planes (runs
 * of 8 each) and widens the high plane's sums against 16s instead of ones: the same exact int32
 * sums, for about twice a 4-bit tile's multiplies. Laying out the codes costs
 * about as much as a few activation rows' products, so from gemm_min_rows rows on it beats the
 * row kernels (which read each weight once and suit small batches). A row's result depends on
 * its own activations only, never on the rows beside it. */
#ifdef HAVE_ZMM_PATH
#define GT 16 /* weight rows per tile: one zmm lane each */
#else
#define GT 8 /* one ymm lane each */
#if defined(__AVXVNNI__)
/* AVX-VNNI (Alder Lake and later Intel cores without AVX-512): the AVX2 GEMM's tiles and passes
 * with vpdpbusd on ymm in place of vpmaddubsw: each lane adds 4 products into int32, so runs
 * are whole halves, nothing is widened, and 8-bit codes need no split. */
#define GEMM_VNNI 1
#endif
#endif

/* Activations for the GEMM, 8 rows (a group, zero-padded) at a time, per chunk one record:
 *   x4[j][i]  (8 x 8 int32)   inputs 4j .. 4j + 3 of row i, the 4 bytes vpdpbusd broadcasts
 *   d[i]      (8 floats)      the chunk's step d_x of row i
 *   iz[h][i]  (2 x 8 int32)   -z S_x,h of row i: starts half h's integer sum (with one scale
 *                             per 32 inputs, iz[0] is the whole chunk's)
 *   ds[h][i]  (2 x 8 floats)  d_x S_x,h, split alike, for the offsets
 * so the kernel reads one record after another from one pointer. */
#define GM 8 /* activation rows per group */
#define GEMM_KC 64 /* chunks per block of the inputs (2048): a multiple of every block's 256 */
#define GEMM_MB 2048 /* activation rows per block, a multiple of GM */
/* Split 8-bit tiles (AVX2) run 8 weight rows a pass where paired 4-bit tiles run 16, so they
 * read the records twice as often: rows in blocks of 512 keep a block's records nearer
 * (int8 at 2048 rows, the 1B's shapes, 2 threads: 90-100 GMAC/s in blocks of 2048, 104-111 in
 * blocks of 512, 97-108 of 256 or 128) */
#define SPLIT_MB 512
#define GREC (13 * GM) /* 32-bit words per (group, chunk) record */

typedef struct {
    int z;      /* the codes' zero point */
    int halves; /* 2: a scale per 16 inputs; 1: per 32 */
    int asym;   /* offsets */
    int umax;   /* the largest code */
    int run;    /* AVX2: vpmaddubsw results summed in int16 before widening (8, 4 or 2) */
    int split;  /* AVX2, 8-bit codes: multiplied as two 4-bit planes, u = 16 hi + lo */
} gemm_traits;

/* The most vpmaddubsw results (each lane a pair of code x activation products, |x| <= 127) an
 * int16 lane holds exactly: 8, 4 or 2 (the AVX2 kernel's runs); 0 when not even 2 fit (int8's
 * codes: one pair alone would saturate). */
static int gemm_run(int umax)
{
    for (int run = 8; run >= 2; run /= 2)
        if (run * 2 * umax * 127 < 32768)
            return run;
    return 0;
}

/* W's codes' traits; 0, or -1 where the GEMM does not take W (dense kinds; an int8 matrix whose
 * groups cut 16-input halves). */
static int gemm_traits_kind(const wdesc *W, gemm_traits *t);
static int gemm_traits_of(const wdesc *W, gemm_traits *t)
{
    if (gemm_traits_kind(W, t))
        return -1;
    t->run = gemm_run(t->umax);
#if defined(HAVE_ZMM_PATH)
    return 0;
#elif defined(GEMM_VNNI)
    t->run = 8; /* "all of a half": vpdpbusd's int32 lanes hold any code's sums */
    return 0;
#else
    /* 8-bit codes (int8's u = q + 128, the iq4 tables'): a pair of products would saturate
     * int16, so each tile is split into its high and low nibbles, two 4-bit planes with runs
     * of 8 (gemm_tile_split_i8); per-32 scales and no offsets, as those formats have */
    if (!t->run && t->umax <= 255 && t->halves == 1 && !t->asym) {
        t->split = 1;
        t->run = gemm_run(15);
    }
    return t->run ? 0 : -1;
#endif
}

static int gemm_traits_kind(const wdesc *W, gemm_traits *t)
{
    switch (W->kind) {
    case KIND_INT4:
    case KIND_INT4Z: { /* int4z: offsets -z s (gemm_codes_row), so codes u - 0 */
        if (W->group_size % 16)
            return -1;
        const int asym = W->kind == KIND_INT4Z || W->offsets != NULL;
        *t = (gemm_traits){asym ? 0 : 8, 1, asym, 15, 0, 0};
        return 0;
    }
    case KIND_INT8:
        if (W->group_size % 16 && W->group_size < W->Kp)
            return -1;
        *t = (gemm_traits){128, 1, 0, 255, 0, 0};
        return 0;
    case KIND_Q4_K_X16: /* q4_k's codes */
        *t = (gemm_traits){0, 1, 1, 15, 0, 0};
        return 0;
    case KIND_INT4_X16: /* int4's */
        *t = W->offsets ? (gemm_traits){0, 1, 1, 15, 0, 0} : (gemm_traits){8, 1, 0, 15, 0, 0};
        return 0;
    case KIND_Q6_K_X16: /* q6_k's */
        *t = (gemm_traits){32, 2, 0, 63, 0, 0};
        return 0;
    default: {
        const ggml_type *g = ggml_type_of(W->kind);
        if (!g)
            return -1;
        *t = (gemm_traits){g->z, g->halves, g->asym, g->umax, 0, 0};
        return 0;
    }
    }
}

/* Inputs k0 .. k1 of row n of W (multiples of 32, and of W's block for the GGML types) as codes
 * u (k1 - k0,), scales s and offsets o ((k1 - k0) / 16,): w = s (u - z) + o per 16 inputs.
 * Inputs past K (the activations' zero padding) get code 0 or a whole group's. The _x16
 * layouts never come here: gemm_pack_tile takes their tiles straight from their vectors. */
static void gemm_codes_row(const wdesc *W, int64_t n, int64_t k0, int64_t k1, uint8_t *u,
                           float *s, float *o)
{
    const int64_t nh = (k1 - k0) / 16;
    if (is_int4(W) || W->kind == KIND_INT8) {
        const int64_t gs = W->group_size, G = W->Kp / gs;
        const half *sc = W->scales + n * G;
        const half *of = W->kind == KIND_INT4 && W->offsets ? W->offsets + n * G : NULL;
        const uint8_t *zp = W->kind == KIND_INT4Z ? W->zeros + n * G : NULL;
        if (is_int4(W)) { /* W->Kp >= k1: whole chunks covering K */
            const uint8_t *row = (const uint8_t *)W->w + n * (W->Kp / 2) + k0 / 2;
            const __m128i m4 = _mm_set1_epi8(15);
            for (int64_t j = 0; j < (k1 - k0) / 2; j += 16) {
                const __m128i b = _mm_loadu_si128((const __m128i *)(row + j));
                const __m128i lo = _mm_and_si128(b, m4);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
                _mm_storeu_si128((__m128i *)(u + 2 * j), _mm_unpacklo_epi8(lo, hi));
                _mm_storeu_si128((__m128i *)(u + 2 * j + 16), _mm_unpackhi_epi8(lo, hi));
            }
        } else { /* u = q + 128; W->Kp may be below k1 (any K), past it q = 0 */
            const int8_t *row = (const int8_t *)W->w + n * W->Kp;
            const int64_t k2 = W->Kp < k1 ? W->Kp : k1;
            int64_t k = k0;
            for (; k + 32 <= k2; k += 32)
                _mm256_storeu_si256((__m256i *)(u + k - k0),
                                    _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + k)),
                                                     _mm256_set1_epi8((char)0x80)));
            for (; k < k2; k++)
                u[k - k0] = (uint8_t)(row[k] ^ 0x80);
            if (k < k1)
                memset(u + k - k0, 128, (size_t)(k1 - k));
        }
        for (int64_t h = 0; h < nh; h++) { /* gs % 16 == 0, or one group (int8) */
            const int64_t k = k0 + 16 * h;
            if (k >= W->Kp) { /* padding only */
                s[h] = o[h] = 0.f;
                continue;
            }
            /* int4z: o = -z s, exact in fp32, so s (u - 0) + o = s (u - z) */
            const int64_t g = k / gs;
            s[h] = (float)sc[g];
            o[h] = zp ? -(float)zp[g] * s[h] : of ? (float)of[g] : 0.f;
        }
        return;
    }
    const ggml_type *t = ggml_type_of(W->kind);
    const uint8_t *row = (const uint8_t *)W->w + n * W->row_bytes;
    for (int64_t b = k0 / t->block; b < k1 / t->block; b++) {
        const int64_t k = b * t->block - k0;
        t->codes(row + b * t->block_bytes, u + k, s + k / 16, o + k / 16);
    }
}

/* The records lie block by block of GEMM_KC chunks, each block's group by group: a block's
 * records are one run of memory (a group's chunks of a block in a row), as the GEMM reads them.
 * Laid out group by group over all the inputs, an 8192-input down projection's block read its
 * 256 groups' records 106 KB apart, 27 MB of pages for 6.8 MB of records (q4_k 8192 x 2048 at
 * 4096 rows, AVX2, one process alternating builds: 144 GMAC/s that way, 153 this way). */
static inline int64_t gemm_block_chunks(int64_t nchunk, int64_t c)
{
    const int64_t c0 = c - c % GEMM_KC;
    return nchunk - c0 < GEMM_KC ? nchunk - c0 : GEMM_KC;
}

/* The first record of the block that holds chunk c (blocks before it: GEMM_KC chunks each) */
static inline int32_t *gemm_recs(int32_t *xg, int64_t groups, int64_t c)
{
    return xg + (c - c % GEMM_KC) * groups * GREC;
}

static void gemm_pack_acts(const qacts *a, int64_t M, int64_t nchunk, int64_t Kp,
                           const gemm_traits *t, int32_t *xg, int nthreads)
{
    const int64_t groups = (M + GM - 1) / GM;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < nchunk; c++) {
            int32_t *rec = gemm_recs(xg, groups, c)
                           + (g * gemm_block_chunks(nchunk, c) + c % GEMM_KC) * GREC;
            for (int i = 0; i < GM; i++) {
                const int64_t m = g * GM + i;
                int32_t S[2] = {0, 0};
                float d = 0.f;
                for (int j = 0; j < 8; j++) {
                    int32_t x4 = 0;
                    if (m < M) {
                        const int8_t *q = a->q + m * Kp + c * CHUNK + 4 * j;
                        memcpy(&x4, q, 4);
                        S[j / 4] += q[0] + q[1] + q[2] + q[3];
                    }
                    rec[j * GM + i] = x4;
                }
                if (m < M)
                    d = a->d[c * a->Mp + m]; /* drow is the 512-bit kernels' only */
                if (t->halves == 1) {
                    S[0] += S[1];
                    S[1] = 0;
                }
                float ds[2] = {d * (float)S[0], d * (float)S[1]};
                memcpy(rec + 8 * GM + i, &d, 4);
                for (int h = 0; h < 2; h++) {
                    rec[(9 + h) * GM + i] = -t->z * S[h];
                    memcpy(rec + (11 + h) * GM + i, ds + h, 4);
                }
            }
        }
}

#ifdef HAVE_ZMM_PATH
/* 16 weight rows (tile, sw, ow: the layout above, scales and offsets (Kp / 16, 16)) against
 * activation group xg: out[i] holds row i's 16 results. */
static inline __attribute__((always_inline)) void
gemm_tile_i8(const uint8_t *tile, const float *sw, const float *ow, const int32_t *xg,
             int64_t nchunk, const int halves, const int asym, __m512 *out)
{
    __m512 f[GM];
    for (int i = 0; i < GM; i++)
        f[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nchunk; c++) {
        const int32_t *rec = xg + c * GREC, *iz = rec + 9 * GM;
        const float *d = (const float *)(rec + 8 * GM), *ds = (const float *)(rec + 11 * GM);
        const uint8_t *tc = tile + c * 8 * 64;
        const __m512 s0 = _mm512_load_ps(sw + 32 * c);
        if (halves == 1) {
            __m512i acc[GM];
            for (int i = 0; i < GM; i++)
                acc[i] = _mm512_set1_epi32(iz[i]);
            for (int j = 0; j < 8; j++) {
                const __m512i w = _mm512_load_si512(tc + j * 64);
                for (int i = 0; i < GM; i++)
                    acc[i] = _mm512_dpbusd_epi32(acc[i], w, _mm512_set1_epi32(rec[j * GM + i]));
            }
            for (int i = 0; i < GM; i++)
                f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]),
                                       _mm512_mul_ps(s0, _mm512_set1_ps(d[i])), f[i]);
        } else {
            __m512i a0[GM], a1[GM];
            for (int i = 0; i < GM; i++) {
                a0[i] = _mm512_set1_epi32(iz[i]);
                a1[i] = _mm512_set1_epi32(iz[GM + i]);
            }
            for (int j = 0; j < 4; j++) {
                const __m512i w0 = _mm512_load_si512(tc + j * 64);
                const __m512i w1 = _mm512_load_si512(tc + (j + 4) * 64);
                for (int i = 0; i < GM; i++) {
                    a0[i] = _mm512_dpbusd_epi32(a0[i], w0, _mm512_set1_epi32(rec[j * GM + i]));
                    a1[i] = _mm512_dpbusd_epi32(a1[i], w1,
                                                _mm512_set1_epi32(rec[(j + 4) * GM + i]));
                }
            }
            const __m512 s1 = _mm512_load_ps(sw + 32 * c + 16);
            for (int i = 0; i < GM; i++) {
                const __m512 dv = _mm512_set1_ps(d[i]);
                f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[i]), _mm512_mul_ps(s0, dv), f[i]);
                f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[i]), _mm512_mul_ps(s1, dv), f[i]);
            }
        }
        if (asym) {
            const __m512 o0 = _mm512_load_ps(ow + 32 * c);
            for (int i = 0; i < GM; i++)
                f[i] = _mm512_fmadd_ps(o0, _mm512_set1_ps(ds[i]), f[i]);
            if (halves == 2) {
                const __m512 o1 = _mm512_load_ps(ow + 32 * c + 16);
                for (int i = 0; i < GM; i++)
                    f[i] = _mm512_fmadd_ps(o1, _mm512_set1_ps(ds[GM + i]), f[i]);
            }
        }
    }
    for (int i = 0; i < GM; i++)
        out[i] = f[i];
}

/* dst[j][r] = src[r * stride + j] for r, j < 16: 32-bit words, dst 64-byte aligned. Four
 * rounds, each swapping the off-diagonal k x k blocks of every 2k x 2k block (k = 8, 4, 2, 1):
 * of rows i and i + k (i & k == 0), row i takes row i + k's columns j - k where j & k, and row
 * i + k row i's columns j + k where !(j & k). */
static inline __attribute__((always_inline)) void
transpose16(const int32_t *src, int64_t stride, int32_t *dst)
{
    /* per round (k = 8, 4, 2, 1): row i's indices (j & k ? 16 + j - k : j), then row i + k's
     * (j & k ? 16 + j : j + k); 16 + x is the second operand's word x */
    static const int32_t idx[4][2][16] __attribute__((aligned(64))) = {
        {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
         {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
        {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
         {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
        {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
         {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
        {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
         {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}}};
    __m512i v[16];
    for (int r = 0; r < 16; r++)
        v[r] = _mm512_loadu_si512(src + r * stride);
    for (int round = 0; round < 4; round++) {
        const int k = 8 >> round;
        const __m512i it = _mm512_load_si512(idx[round][0]), ib = _mm512_load_si512(idx[round][1]);
        for (int i = 0; i < 16; i++)
            if (!(i & k)) {
                const __m512i a = v[i], b = v[i + k];
                v[i] = _mm512_permutex2var_epi32(a, it, b);
                v[i + k] = _mm512_permutex2var_epi32(a, ib, b);
            }
    }
    for (int j = 0; j < 16; j++)
        _mm512_store_si512(dst + 16 * j, v[j]);
}

/* The row-major codes u (16, Kb) and scales and offsets so (2, 16, nh) of a tile's rows in the
 * GEMM's layout (tile, sw, ow): 16 x 16 blocks of 32-bit words transposed in registers, a last
 * partial block gathered. */
static void tile_layout(const uint8_t *u, const float *so, int64_t Kb, int64_t nh,
                        uint8_t *tile, float *sw, float *ow)
{
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i rb = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)Kb)); /* bytes */
    const __m512i rh = _mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)nh)); /* floats */
    int64_t q = 0, h = 0;
    for (; q + 16 <= Kb / 4; q += 16)
        transpose16((const int32_t *)u + q, Kb / 4, (int32_t *)(tile + q * 64));
    for (; q < Kb / 4; q++)
        _mm512_store_si512(tile + q * 64, _mm512_i32gather_epi32(rb, u + 4 * q, 1));
    for (; h + 16 <= nh; h += 16) {
        transpose16((const int32_t *)so + h, nh, (int32_t *)(sw + h * GT));
        transpose16((const int32_t *)so + GT * nh + h, nh, (int32_t *)(ow + h * GT));
    }
    for (; h < nh; h++) {
        _mm512_store_ps(sw + h * GT, _mm512_i32gather_ps(rh, so + h, 4));
        _mm512_store_ps(ow + h * GT, _mm512_i32gather_ps(rh, so + GT * nh + h, 4));
    }
}

/* One tile (chunks c0 .. c0 + cn of its rows) against activation rows m0 .. m1 (m0 a multiple
 * of GM; xb: the block's records, gemm_recs), into y: stored with the bias for the first chunks
 * (c0 == 0), added after. */
static void gemm_tile_rows(const wdesc *W, const gemm_traits *t, const uint8_t *tile,
                           const float *sw, const float *ow, const int32_t *xb,
                           int64_t c0, int64_t cn, int64_t m0, int64_t m1, int64_t n0, float *y,
                           int64_t ldy)
{
    const int64_t nr = W->N - n0 < GT ? W->N - n0 : GT;
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    const __m512 bias = W->bias ? _mm512_maskz_loadu_ps(k, W->bias + n0) : _mm512_setzero_ps();
    for (int64_t g = m0 / GM; g * GM < m1; g++) {
        __m512 out[GM];
        const int32_t *xr = xb + g * cn * GREC;
        if (t->halves == 1 && !t->asym)
            gemm_tile_i8(tile, sw, ow, xr, cn, 1, 0, out);
        else if (t->halves == 1)
            gemm_tile_i8(tile, sw, ow, xr, cn, 1, 1, out);
        else if (!t->asym)
            gemm_tile_i8(tile, sw, ow, xr, cn, 2, 0, out);
        else
            gemm_tile_i8(tile, sw, ow, xr, cn, 2, 1, out);
        for (int i = 0; i < GM && g * GM + i < m1; i++) {
            float *yr = y + (g * GM + i) * ldy + n0;
            const __m512 prev = c0 ? _mm512_maskz_loadu_ps(k, yr) : bias;
            _mm512_mask_storeu_ps(yr, k, _mm512_add_ps(out[i], prev));
        }
    }
}
#else /* AVX2 */

/* A run of R weight vectors (t: R x 32 bytes, 8 rows' 4 codes each) against G activation rows
 * (r: the group's words for the run's first vector, GM a vector): p[i] = the sum over the run of
 * vpmaddubsw(vector, row i's 4 bytes broadcast), in int16 (exact for runs up to gemm_run's).
 * Written in asm because GCC, given the intrinsics, hoists a chunk's broadcasts ahead of their
 * multiplies and spills the products to the stack: the q4_k GEMM issued ~0.6 vpmaddubsw a cycle
 * where a Zen 4 issues 2 (its AVX2 build, 1B shapes, 2 threads, one process alternating
 * builds: 154-171 GMAC/s, 192-212 with this; q6_k +15%, int4 +36%). Each step is a broadcast,
 * a multiply and an add into a register, in the intrinsics' order, so the sums are theirs bit
 * for bit. */
_Static_assert(GM == 8, "bm_run's offsets take GM words a vector");
#define BM_W(v) "vmovdqa " #v "*32(%[t]), %%ymm14\n\t"
#define BM_X(v, i) "vpbroadcastd (" #v "*8+" #i ")*4(%[r]), %%ymm15\n\t"
#define BM_SET(v, i) BM_X(v, i) "vpmaddubsw %%ymm15, %%ymm14, %[p" #i "]\n\t"
#define BM_ADD(v, i)                                                                           \
    BM_X(v, i) "vpmaddubsw %%ymm15, %%ymm14, %%ymm15\n\t"                                     \
               "vpaddw %%ymm15, %[p" #i "], %[p" #i "]\n\t"
#define BM_SET4(v) BM_W(v) BM_SET(v, 0) BM_SET(v, 1) BM_SET(v, 2) BM_SET(v, 3)
#define BM_ADD4(v) BM_W(v) BM_ADD(v, 0) BM_ADD(v, 1) BM_ADD(v, 2) BM_ADD(v, 3)
#define BM_SET8(v) BM_SET4(v) BM_SET(v, 4) BM_SET(v, 5) BM_SET(v, 6) BM_SET(v, 7)
#define BM_ADD8(v) BM_ADD4(v) BM_ADD(v, 4) BM_ADD(v, 5) BM_ADD(v, 6) BM_ADD(v, 7)
#define BM_OUT4 [p0] "=&x"(p[0]), [p1] "=&x"(p[1]), [p2] "=&x"(p[2]), [p3] "=&x"(p[3])
#define BM_OUT8 BM_OUT4, [p4] "=&x"(p[4]), [p5] "=&x"(p[5]), [p6] "=&x"(p[6]), [p7] "=&x"(p[7])
#define BM_IN(R) [t] "r"(t), [r] "r"(r), "m"(*(const uint8_t(*)[R * 32])t), \
                 "m"(*(const int32_t(*)[R * GM])r)
static inline __attribute__((always_inline)) void bm_run(const uint8_t *t, const int32_t *r,
                                                         __m256i *p, const int R, const int G)
{
    if (G == 8 && R == 8)
        __asm__(BM_SET8(0) BM_ADD8(1) BM_ADD8(2) BM_ADD8(3) BM_ADD8(4) BM_ADD8(5) BM_ADD8(6)
                BM_ADD8(7) : BM_OUT8 : BM_IN(8) : "xmm14", "xmm15");
    else if (G == 8 && R == 4)
        __asm__(BM_SET8(0) BM_ADD8(1) BM_ADD8(2) BM_ADD8(3)
                : BM_OUT8 : BM_IN(4) : "xmm14", "xmm15");
    else if (G == 4 && R == 4)
        __asm__(BM_SET4(0) BM_ADD4(1) BM_ADD4(2) BM_ADD4(3)
                : BM_OUT4 : BM_IN(4) : "xmm14", "xmm15");
    else if (G == 4 && R == 2)
        __asm__(BM_SET4(0) BM_ADD4(1) : BM_OUT4 : BM_IN(2) : "xmm14", "xmm15");
    else
        __builtin_unreachable();
}

/* As bm_run for two tiles' runs (ta, tb) against 4 activation rows: pa, pb; each broadcast
 * serves both tiles' vectors (gemm_tile2_i8). */
#define BM2_W(v) "vmovdqa " #v "*32(%[ta]), %%ymm14\n\tvmovdqa " #v "*32(%[tb]), %%ymm13\n\t"
#define BM2_SET(v, i)                                                                          \
    BM_X(v, i) "vpmaddubsw %%ymm15, %%ymm14, %[a" #i "]\n\t"                                   \
               "vpmaddubsw %%ymm15, %%ymm13, %[b" #i "]\n\t"
#define BM2_ADD(v, i)                                                                          \
    BM_X(v, i) "vpmaddubsw %%ymm15, %%ymm14, %%ymm12\n\t"                                     \
               "vpaddw %%ymm12, %[a" #i "], %[a" #i "]\n\t"                                   \
               "vpmaddubsw %%ymm15, %%ymm13, %%ymm12\n\t"                                     \
               "vpaddw %%ymm12, %[b" #i "], %[b" #i "]\n\t"
#define BM2_SET4(v) BM2_W(v) BM2_SET(v, 0) BM2_SET(v, 1) BM2_SET(v, 2) BM2_SET(v, 3)
#define BM2_ADD4(v) BM2_W(v) BM2_ADD(v, 0) BM2_ADD(v, 1) BM2_ADD(v, 2) BM2_ADD(v, 3)
#define BM2_OUT                                                                                \
    [a0] "=&x"(pa[0]), [a1] "=&x"(pa[1]), [a2] "=&x"(pa[2]), [a3] "=&x"(pa[3]),                \
    [b0] "=&x"(pb[0]), [b1] "=&x"(pb[1]), [b2] "=&x"(pb[2]), [b3] "=&x"(pb[3])
#define BM2_IN(R)                                                                              \
    [ta] "r"(ta), [tb] "r"(tb), [r] "r"(r), "m"(*(const uint8_t(*)[R * 32])ta),                \
    "m"(*(const uint8_t(*)[R * 32])tb), "m"(*(const int32_t(*)[R * GM])r)
static inline __attribute__((always_inline)) void bm_run2(const uint8_t *ta, const uint8_t *tb,
                                                          const int32_t *r, __m256i *pa,
                                                          __m256i *pb, const int R)
{
    if (R == 8)
        __asm__(BM2_SET4(0) BM2_ADD4(1) BM2_ADD4(2) BM2_ADD4(3) BM2_ADD4(4) BM2_ADD4(5)
                BM2_ADD4(6) BM2_ADD4(7) : BM2_OUT : BM2_IN(8) : "xmm12", "xmm13", "xmm14", "xmm15");
    else if (R == 4)
        __asm__(BM2_SET4(0) BM2_ADD4(1) BM2_ADD4(2) BM2_ADD4(3)
                : BM2_OUT : BM2_IN(4) : "xmm12", "xmm13", "xmm14", "xmm15");
    else if (R == 2)
        __asm__(BM2_SET4(0) BM2_ADD4(1) : BM2_OUT : BM2_IN(2) : "xmm12", "xmm13", "xmm14", "xmm15");
    else
        __builtin_unreachable();
}

#ifdef GEMM_VNNI
/* As bm_run and bm_run2 with AVX-VNNI: acc[i] += vpdpbusd(vector, row i's 4 bytes broadcast)
 * over R vectors, straight into the int32 sums (exact: a half's are at most 32 x 255 x 128).
 * %{vex%} is the assembler's {vex}: the VEX form (AVX-VNNI), not the EVEX one (AVX512-VNNI,
 * which a CPU without AVX-512 does not have) that it picks otherwise. */
#define BV(v, i, a) BM_X(v, i) "%{vex%} vpdpbusd %%ymm15, %%ymm14, %[" #a #i "]\n\t"
#define BV4(v, a) BM_W(v) BV(v, 0, a) BV(v, 1, a) BV(v, 2, a) BV(v, 3, a)
#define BV8(v, a) BV4(v, a) BV(v, 4, a) BV(v, 5, a) BV(v, 6, a) BV(v, 7, a)
#define BV_IO(p, a, n) [a##n] "+x"(p[n])
#define BV_IO4(p, a) BV_IO(p, a, 0), BV_IO(p, a, 1), BV_IO(p, a, 2), BV_IO(p, a, 3)
#define BV_IO8(p, a) BV_IO4(p, a), BV_IO(p, a, 4), BV_IO(p, a, 5), BV_IO(p, a, 6), BV_IO(p, a, 7)
static inline __attribute__((always_inline)) void bv_run(const uint8_t *t, const int32_t *r,
                                                         __m256i *acc, const int R)
{
    if (R == 8)
        __asm__(BV8(0, p) BV8(1, p) BV8(2, p) BV8(3, p) BV8(4, p) BV8(5, p) BV8(6, p) BV8(7, p)
                : BV_IO8(acc, p) : BM_IN(8) : "xmm14", "xmm15");
    else if (R == 4)
        __asm__(BV8(0, p) BV8(1, p) BV8(2, p) BV8(3, p) : BV_IO8(acc, p) : BM_IN(4)
                : "xmm14", "xmm15");
    else
        __builtin_unreachable();
}

/* 4 activation rows against two tiles (ta: ymm14, tb: ymm13), each broadcast serving both */
#define BV2(v, i)                                                                              \
    BM_X(v, i) "%{vex%} vpdpbusd %%ymm15, %%ymm14, %[a" #i "]\n\t"                               \
               "%{vex%} vpdpbusd %%ymm15, %%ymm13, %[b" #i "]\n\t"
#define BV2_4(v) BM2_W(v) BV2(v, 0) BV2(v, 1) BV2(v, 2) BV2(v, 3)
static inline __attribute__((always_inline)) void bv_run2(const uint8_t *ta, const uint8_t *tb,
                                                          const int32_t *r, __m256i *acca,
                                                          __m256i *accb, const int R)
{
    if (R == 8)
        __asm__(BV2_4(0) BV2_4(1) BV2_4(2) BV2_4(3) BV2_4(4) BV2_4(5) BV2_4(6) BV2_4(7)
                : BV_IO4(acca, a), BV_IO4(accb, b) : BM2_IN(8) : "xmm13", "xmm14", "xmm15");
    else if (R == 4)
        __asm__(BV2_4(0) BV2_4(1) BV2_4(2) BV2_4(3)
                : BV_IO4(acca, a), BV_IO4(accb, b) : BM2_IN(4) : "xmm13", "xmm14", "xmm15");
    else
        __builtin_unreachable();
}
#endif

/* 8 weight rows (tile, sw, ow: the layout above with 8 lanes) against activation group xg:
 * out[i] holds row i's 8 results. vpmaddubsw (codes unsigned, the activations signed) adds a
 * pair of products into each int16 lane; `run` of them are summed in int16 (exact: gemm_run),
 * then widened by one vpmaddwd against ones. Where a run is a whole half (4-bit codes) all 8
 * activation rows go at once, each weight vector loaded once for 8 rows (q4_k, 512 x 2048 x
 * 8192: 199 GMAC/s against 116 in two passes of 4); with shorter runs the int32 sums need 8
 * more registers than the 16 there are, and two passes of 4 rows ran faster (q6_k 154 against
 * 139). */
static inline __attribute__((always_inline)) void
gemm_tile_i8(const uint8_t *tile, const float *sw, const float *ow, const int32_t *xg,
             int64_t nchunk, const int halves, const int asym, const int run, __m256 *out)
{
    const __m256i ones = _mm256_set1_epi16(1);
    const int nj = halves == 1 ? 8 : 4; /* vectors a half */
#ifdef GEMM_VNNI
    (void)ones, (void)run;
    const int GMH = GM; /* a half at once for all 8 rows */
#else
    const int GMH = run >= nj ? GM : 4; /* activation rows a pass */
#endif
    for (int i0 = 0; i0 < GM; i0 += GMH) {
        __m256 f[GM];
        for (int i = 0; i < GMH; i++)
            f[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nchunk; c++) {
            const int32_t *rec = xg + c * GREC, *iz = rec + 9 * GM;
            const float *d = (const float *)(rec + 8 * GM), *ds = (const float *)(rec + 11 * GM);
            const uint8_t *tc = tile + c * 8 * 32;
            for (int h = 0; h < halves; h++) {
                __m256i acc[GM]; /* codes with offsets have z = 0 (gemm_traits_kind): no iz */
                for (int i = 0; i < GMH; i++)
                    acc[i] = asym ? _mm256_setzero_si256()
                                  : _mm256_set1_epi32(iz[h * GM + i0 + i]);
#ifdef GEMM_VNNI
                bv_run(tc + h * nj * 32, rec + h * nj * GM + i0, acc, nj);
#else
                for (int j = 0; j < nj; j += run) {
                    __m256i p[GM];
                    const int v = h * nj + j; /* the run's first vector */
                    bm_run(tc + v * 32, rec + v * GM + i0, p, run < nj ? run : nj, GMH);
                    for (int i = 0; i < GMH; i++)
                        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p[i], ones));
                }
#endif
                const __m256 sh = _mm256_load_ps(sw + (2 * c + h) * GT);
                for (int i = 0; i < GMH; i++)
                    f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]),
                                           _mm256_mul_ps(sh, _mm256_set1_ps(d[i0 + i])), f[i]);
            }
            if (asym)
                for (int h = 0; h < halves; h++) {
                    const __m256 oh = _mm256_load_ps(ow + (2 * c + h) * GT);
                    for (int i = 0; i < GMH; i++)
                        f[i] = _mm256_fmadd_ps(oh, _mm256_set1_ps(ds[h * GM + i0 + i]), f[i]);
                }
        }
        for (int i = 0; i < GMH; i++)
            out[i0 + i] = f[i];
    }
}

/* Two tiles at once (weight rows n0 .. n0 + 15: a and b, 8 each) against activation group xg,
 * for codes with one scale per 32 inputs (halves == 1), runs of 8 or 4 (q4_k, int4, q4_0,
 * q5_0, q5_1, q5_k), or per 16 (halves == 2), runs of 4 or 2 (q2_k, q3_k, q6_k): each
 * broadcast activation word serves both tiles' vectors, so a vpmaddubsw costs half a
 * broadcast, not one. 4 activation rows a pass: 8 int16 sums, 2 weight vectors and a
 * broadcast in registers. On a Zen 4 running the AVX2 build (2 threads, 1B shapes, one process
 * alternating builds) int4_x16 went from 129-135 to 148-159 GMAC/s at 128 rows; with the runs
 * in asm (bm_run2), codes with offsets too: q4_k_x16 4-13% faster than one tile at 32 and 512
 * rows, q5_k and q5_1 8-18% (compiled from intrinsics, the offsets' extra load and fmadd had
 * made it 5-8% slower). Per 16 inputs (2026-12-05, a Sapphire Rapids VM built for AVX2, 2
 * threads, 128 rows, one matrix, separate processes alternated): q3_k and q2_k 2048 x 8192
 * 6-13% faster, q6_k_x16 8192 x 2048 121-126 -> 129-138 GMAC/s and 2048 x 8192 the same
 * (125-136 against 133-137): its runs of 2 are widened, and its halves scaled, apart either
 * way. The integer sums and the float operations per lane are gemm_tile_i8's, in the same
 * order, so a row's result does not depend on whether its tile ran paired (GEMM_PAIR=0 builds
 * without). */
#ifndef GEMM_PAIR
#define GEMM_PAIR 1
#endif
static inline __attribute__((always_inline)) void
gemm_tile2_i8(const uint8_t *ta, const uint8_t *tb, const float *swa, const float *swb,
              const float *owa, const float *owb, const int32_t *xg, int64_t nchunk,
              const int halves, const int run, const int asym, __m256 *outa, __m256 *outb)
{
    const __m256i ones = _mm256_set1_epi16(1);
    const int R = 4, nj = halves == 1 ? 8 : 4; /* vectors a half */
#ifdef GEMM_VNNI
    (void)ones, (void)run;
#endif
    for (int i0 = 0; i0 < GM; i0 += R) {
        __m256 fa[4], fb[4];
        for (int i = 0; i < R; i++)
            fa[i] = fb[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nchunk; c++) {
            const int32_t *rec = xg + c * GREC, *iz = rec + 9 * GM;
            const float *d = (const float *)(rec + 8 * GM);
            const float *ds = (const float *)(rec + 11 * GM);
            const uint8_t *tca = ta + c * 8 * 32, *tcb = tb + c * 8 * 32;
            for (int h = 0; h < halves; h++) {
                __m256i acca[4], accb[4];
                for (int i = 0; i < R; i++)
                    acca[i] = accb[i] = asym ? _mm256_setzero_si256()
                                             : _mm256_set1_epi32(iz[h * GM + i0 + i]);
#ifdef GEMM_VNNI
                bv_run2(tca + h * nj * 32, tcb + h * nj * 32, rec + h * nj * GM + i0, acca, accb,
                        nj);
#else
                for (int j = 0; j < nj; j += run) {
                    __m256i pa[4], pb[4];
                    const int v = h * nj + j; /* the run's first vector */
                    bm_run2(tca + v * 32, tcb + v * 32, rec + v * GM + i0, pa, pb, run);
                    for (int i = 0; i < R; i++) {
                        acca[i] = _mm256_add_epi32(acca[i], _mm256_madd_epi16(pa[i], ones));
                        accb[i] = _mm256_add_epi32(accb[i], _mm256_madd_epi16(pb[i], ones));
                    }
                }
#endif
                const __m256 sa = _mm256_load_ps(swa + (2 * c + h) * GT);
                const __m256 sb = _mm256_load_ps(swb + (2 * c + h) * GT);
                for (int i = 0; i < R; i++) {
                    const __m256 di = _mm256_set1_ps(d[i0 + i]);
                    fa[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acca[i]), _mm256_mul_ps(sa, di),
                                            fa[i]);
                    fb[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(accb[i]), _mm256_mul_ps(sb, di),
                                            fb[i]);
                }
            }
            if (asym)
                for (int h = 0; h < halves; h++) {
                    const __m256 oa = _mm256_load_ps(owa + (2 * c + h) * GT);
                    const __m256 ob = _mm256_load_ps(owb + (2 * c + h) * GT);
                    for (int i = 0; i < R; i++) {
                        const __m256 dsi = _mm256_set1_ps(ds[h * GM + i0 + i]);
                        fa[i] = _mm256_fmadd_ps(oa, dsi, fa[i]);
                        fb[i] = _mm256_fmadd_ps(ob, dsi, fb[i]);
                    }
                }
        }
        for (int i = 0; i < R; i++) {
            outa[i0 + i] = fa[i];
            outb[i0 + i] = fb[i];
        }
    }
}

/* 8 weight rows of 8-bit codes u = 16 h + l (th, tl: the tile's high and low nibbles, each in
 * the tile layout, gemm_split_tile; scales sw with one per 32 inputs, no offsets) against
 * activation group xg: out[i] holds row i's 8 results. Both planes are 4-bit codes, so each
 * plane's vpmaddubsw pairs sum in int16 for runs of 8 (8 x 2 x 15 x 127 < 2^15), h's widened
 * against 16s and l's against ones into one int32 sum per chunk, exactly sum u q_x: from there
 * on gemm_tile_i8's float operations in its order. 4 activation rows a pass, as gemm_tile2_i8:
 * each broadcast serves both planes' vectors. */
static inline __attribute__((always_inline)) void
gemm_tile_split_i8(const uint8_t *th, const uint8_t *tl, const float *sw, const int32_t *xg,
                   int64_t nchunk, __m256 *out)
{
    const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
    const int R = 4;
    for (int i0 = 0; i0 < GM; i0 += R) {
        __m256 f[4];
        for (int i = 0; i < R; i++)
            f[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nchunk; c++) {
            const int32_t *rec = xg + c * GREC, *iz = rec + 9 * GM;
            const float *d = (const float *)(rec + 8 * GM);
            __m256i ph[4], pl[4];
            bm_run2(th + c * 8 * 32, tl + c * 8 * 32, rec + i0, ph, pl, 8);
            const __m256 s = _mm256_load_ps(sw + 2 * c * GT);
            for (int i = 0; i < R; i++) {
                const __m256i acc = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_set1_epi32(iz[i0 + i]),
                                     _mm256_madd_epi16(ph[i], sixteen)),
                    _mm256_madd_epi16(pl[i], ones));
                f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc),
                                       _mm256_mul_ps(s, _mm256_set1_ps(d[i0 + i])), f[i]);
            }
        }
        for (int i = 0; i < R; i++)
            out[i0 + i] = f[i];
    }
}

/* A tile of 8-bit codes (cn chunks, the tile layout) into its high nibbles, in place, and its
 * low nibbles, into tl: gemm_tile_split_i8's planes. */
static void gemm_split_tile(uint8_t *tile, uint8_t *tl, int64_t cn)
{
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t q = 0; q < cn * 8; q++) {
        const __m256i v = _mm256_load_si256((const __m256i *)(tile + q * 32));
        _mm256_store_si256((__m256i *)(tl + q * 32), _mm256_and_si256(v, m4));
        _mm256_store_si256((__m256i *)(tile + q * 32),
                           _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    }
}

/* As gemm_tile_rows for the 16 weight rows of two tiles (gemm_tile2_i8: t->run >= 4, or >= 2
 * where t->halves == 2); rows past N masked. */
static void gemm_tile_rows2(const wdesc *W, const gemm_traits *t, const uint8_t *ta,
                            const float *swa, const float *owa, const uint8_t *tb,
                            const float *swb, const float *owb, const int32_t *xb, int64_t c0,
                            int64_t cn, int64_t m0, int64_t m1, int64_t n0, float *y, int64_t ldy)
{
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t na = W->N - n0 < GT ? W->N - n0 : GT;
    const int64_t nb = W->N - n0 - GT < GT ? W->N - n0 - GT : GT;
    const __m256i ka = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)na), lanes);
    const __m256i kb = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nb), lanes);
    const __m256 biasa = W->bias ? _mm256_maskload_ps(W->bias + n0, ka) : _mm256_setzero_ps();
    const __m256 biasb = W->bias ? _mm256_maskload_ps(W->bias + n0 + GT, kb) : _mm256_setzero_ps();
    for (int64_t g = m0 / GM; g * GM < m1; g++) {
        __m256 outa[GM], outb[GM];
        const int32_t *xr = xb + g * cn * GREC;
#define TILE2(h, r, a) gemm_tile2_i8(ta, tb, swa, swb, owa, owb, xr, cn, h, r, a, outa, outb)
        if (t->halves == 1)
            t->run >= 8 ? (t->asym ? TILE2(1, 8, 1) : TILE2(1, 8, 0))
                        : (t->asym ? TILE2(1, 4, 1) : TILE2(1, 4, 0));
        else
            t->run >= 4 ? (t->asym ? TILE2(2, 4, 1) : TILE2(2, 4, 0))
                        : (t->asym ? TILE2(2, 2, 1) : TILE2(2, 2, 0));
#undef TILE2
        for (int i = 0; i < GM && g * GM + i < m1; i++) {
            float *yr = y + (g * GM + i) * ldy + n0;
            if (nb == GT) { /* whole tiles: plain loads and stores (masked ones are slow on AMD) */
                const __m256 pa = c0 ? _mm256_loadu_ps(yr) : biasa;
                const __m256 pb = c0 ? _mm256_loadu_ps(yr + GT) : biasb;
                _mm256_storeu_ps(yr, _mm256_add_ps(outa[i], pa));
                _mm256_storeu_ps(yr + GT, _mm256_add_ps(outb[i], pb));
                continue;
            }
            const __m256 pa = c0 ? _mm256_maskload_ps(yr, ka) : biasa;
            const __m256 pb = c0 ? _mm256_maskload_ps(yr + GT, kb) : biasb;
            _mm256_maskstore_ps(yr, ka, _mm256_add_ps(outa[i], pa));
            _mm256_maskstore_ps(yr + GT, kb, _mm256_add_ps(outb[i], pb));
        }
    }
}

/* dst[j][r] = src[r * stride + j] for r, j < 8: 32-bit words, dst 32-byte aligned */
static inline __attribute__((always_inline)) void
transpose8(const int32_t *src, int64_t stride, int32_t *dst)
{
    __m256 r[8], t[8], q[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm256_loadu_ps((const float *)(src + i * stride));
    for (int i = 0; i < 8; i += 2) { /* rows i, i + 1 interleaved by words */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* 4 rows' words 0 / 4, 1 / 5, 2 / 6, 3 / 7 */
        q[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        q[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        q[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        q[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) { /* rows 0-3 and 4-7 joined: words j and j + 4 */
        _mm256_store_ps((float *)(dst + 8 * j), _mm256_permute2f128_ps(q[j], q[4 + j], 0x20));
        _mm256_store_ps((float *)(dst + 8 * (j + 4)), _mm256_permute2f128_ps(q[j], q[4 + j], 0x31));
    }
}

/* As the 512-bit tile_layout, 8 rows: 8 x 8 blocks transposed, a last partial block gathered */
static void tile_layout(const uint8_t *u, const float *so, int64_t Kb, int64_t nh,
                        uint8_t *tile, float *sw, float *ow)
{
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i rb = _mm256_mullo_epi32(lanes, _mm256_set1_epi32((int)Kb)); /* bytes */
    const __m256i rh = _mm256_mullo_epi32(lanes, _mm256_set1_epi32((int)nh)); /* floats */
    int64_t q = 0, h = 0;
    for (; q + 8 <= Kb / 4; q += 8)
        transpose8((const int32_t *)u + q, Kb / 4, (int32_t *)(tile + q * 32));
    for (; q < Kb / 4; q++)
        _mm256_store_si256((__m256i *)(tile + q * 32),
                           _mm256_i32gather_epi32((const int *)(u + 4 * q), rb, 1));
    for (; h + 8 <= nh; h += 8) {
        transpose8((const int32_t *)so + h, nh, (int32_t *)(sw + h * GT));
        transpose8((const int32_t *)so + GT * nh + h, nh, (int32_t *)(ow + h * GT));
    }
    for (; h < nh; h++) {
        _mm256_store_ps(sw + h * GT, _mm256_i32gather_ps(so + h, rh, 4));
        _mm256_store_ps(ow + h * GT, _mm256_i32gather_ps(so + GT * nh + h, rh, 4));
    }
}

/* As the 512-bit gemm_tile_rows, 8 weight rows (masked stores past N); with t->split, tile and
 * tl are the codes' two planes (gemm_split_tile) */
static void gemm_tile_rows(const wdesc *W, const gemm_traits *t, const uint8_t *tile,
                           const uint8_t *tl, const float *sw, const float *ow,
                           const int32_t *xb, int64_t c0, int64_t cn, int64_t m0, int64_t m1,
                           int64_t n0, float *y, int64_t ldy)
{
    const int64_t nr = W->N - n0 < GT ? W->N - n0 : GT;
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nr),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 bias = W->bias ? _mm256_maskload_ps(W->bias + n0, k) : _mm256_setzero_ps();
    /* run: as many as gemm_run allows, 8 standing for "all of a half" (4 with two halves) */
#define TILE(h, a)                                                                             \
    (t->run >= 8   ? gemm_tile_i8(tile, sw, ow, xr, cn, h, a, 8, out)                           \
     : t->run >= 4 ? gemm_tile_i8(tile, sw, ow, xr, cn, h, a, 4, out)                           \
                   : gemm_tile_i8(tile, sw, ow, xr, cn, h, a, 2, out))
    for (int64_t g = m0 / GM; g * GM < m1; g++) {
        __m256 out[GM];
        const int32_t *xr = xb + g * cn * GREC;
        if (t->split)
            gemm_tile_split_i8(tile, tl, sw, xr, cn, out);
        else if (t->halves == 1 && !t->asym)
            TILE(1, 0);
        else if (t->halves == 1)
            TILE(1, 1);
        else if (!t->asym)
            TILE(2, 0);
        else
            TILE(2, 1);
        for (int i = 0; i < GM && g * GM + i < m1; i++) {
            float *yr = y + (g * GM + i) * ldy + n0;
            if (nr == GT) { /* a whole tile: plain loads and stores (masked ones are slow on AMD) */
                _mm256_storeu_ps(yr, _mm256_add_ps(out[i], c0 ? _mm256_loadu_ps(yr) : bias));
                continue;
            }
            const __m256 prev = c0 ? _mm256_maskload_ps(yr, k) : bias;
            _mm256_maskstore_ps(yr, k, _mm256_add_ps(out[i], prev));
        }
    }
#undef TILE
}
#endif /* HAVE_ZMM_PATH */

#ifndef HAVE_ZMM_PATH
_Static_assert(X16Y_GT == GT, "the AVX2 _x16 tile packers write GT-row tiles");
#endif

/* Rows n0 .. n0 + GT - 1 of W (those below N), chunks c0 .. c0 + cn, as codes into tile and
 * their scales and offsets into sw, ow (the layout above), through row-major buffers u (GT,
 * 32 cn) and so (2, GT, 2 cn). Rows past N read as code 0 with scale 0. */
static void gemm_pack_tile(const wdesc *W, int64_t n0, int64_t c0, int64_t cn, uint8_t *u,
                           float *so, uint8_t *tile, float *sw, float *ow)
{
    if (W->kind == KIND_Q4_K_X16) { /* the _x16 layouts: straight from their vectors */
        x16_pack_tile(W, n0, c0, cn, tile, sw, ow);
        return;
    }
    if (W->kind == KIND_Q6_K_X16) {
        x16q6_pack_tile(W, n0, c0, cn, tile, sw, ow);
        return;
    }
    if (W->kind == KIND_INT4_X16) {
        x16i4_pack_tile(W, n0, c0, cn, tile, sw, ow);
        return;
    }
    const int64_t Kb = cn * CHUNK, nh = Kb / 16;
    for (int r = 0; r < GT; r++) {
        if (n0 + r < W->N)
            gemm_codes_row(W, n0 + r, c0 * CHUNK, c0 * CHUNK + Kb, u + r * Kb, so + r * nh,
                           so + (GT + r) * nh);
        else {
            memset(u + r * Kb, 0, (size_t)Kb);
            memset(so + r * nh, 0, sizeof(float) * (size_t)nh);
            memset(so + (GT + r) * nh, 0, sizeof(float) * (size_t)nh);
        }
    }
    tile_layout(u, so, Kb, nh, tile, sw, ow);
}

/* y (M, N) row stride ldy = x (M, K) W^T (+ bias) through the int8 GEMM; 0, or -1 for a kind it
 * does not take (f32 / f16 / bf16 keep their float GEMM; gemm_traits_of). */
int wgemm_i8(const wdesc *W, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
             int nthreads)
{
    gemm_traits t;
    if (gemm_traits_of(W, &t))
        return -1;
    const int64_t nchunk = (W->K + CHUNK - 1) / CHUNK, Kp = nchunk * CHUNK;
    const qacts a = quantize_activations(x, M, W->K, ldx, Kp, ACT_PLAIN, 0, nthreads);
    const int64_t groups = (M + GM - 1) / GM;
    int32_t *xg = aligned_alloc(64, sizeof(int32_t) * (size_t)(groups * nchunk * GREC));
    gemm_pack_acts(&a, M, nchunk, Kp, &t, xg, nthreads);
    free_activations(a);
    /* Blocks of at most GEMM_KC chunks and GEMM_MB rows: every tile runs against one block's
     * activations (M x GEMM_KC chunks of records, at most 6.8 MB) before the next, so they stay
     * in L3; unblocked, a 2048 x 8192 down projection read its 27 MB of records from DRAM once
     * per tile (1B shapes, Zen 5: 120 GMAC/s against 363 at 512 rows). */
    const int64_t kc = nchunk < GEMM_KC ? nchunk : GEMM_KC, nhb = 2 * kc;
#ifdef HAVE_ZMM_PATH
    const int64_t step = GT;
#else /* two tiles at a time where gemm_tile2_i8 takes the codes */
    const int64_t step = GEMM_PAIR && !t.split && t.run >= (t.halves == 1 ? 4 : 2) ? 2 * GT : GT;
#endif
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *u = aligned_alloc(64, (size_t)(kc * CHUNK * GT));
        /* tiles laid out at once, each with its sw, ow (a split tile's second: its low plane) */
        const int64_t ntile = t.split ? 2 : step / GT;
        uint8_t *tile = aligned_alloc(64, (size_t)(ntile * kc * CHUNK * GT));
        float *so = malloc(sizeof(float) * (size_t)(2 * GT * nhb));
        float *sw = aligned_alloc(64, sizeof(float) * (size_t)(ntile * 2 * GT * nhb));
        float *ow = sw + GT * nhb;
        const int64_t mb = t.split ? SPLIT_MB : GEMM_MB;
        for (int64_t m0 = 0; m0 < M; m0 += mb) {
            const int64_t m1 = M - m0 < mb ? M : m0 + mb;
            for (int64_t c0 = 0; c0 < nchunk; c0 += GEMM_KC) {
                const int64_t cn = gemm_block_chunks(nchunk, c0);
                const int32_t *xb = gemm_recs(xg, groups, c0);
                /* the implicit barrier: a block's sums are in y before the next adds to them */
#pragma omp for schedule(dynamic, 1)
                for (int64_t n0 = 0; n0 < W->N; n0 += step) {
                    gemm_pack_tile(W, n0, c0, cn, u, so, tile, sw, ow);
#ifndef HAVE_ZMM_PATH
                    if (step > GT && n0 + GT < W->N) { /* the second tile after the first */
                        uint8_t *tile2 = tile + kc * CHUNK * GT;
                        float *sw2 = sw + 2 * GT * nhb;
                        gemm_pack_tile(W, n0 + GT, c0, cn, u, so, tile2, sw2, sw2 + GT * nhb);
                        gemm_tile_rows2(W, &t, tile, sw, ow, tile2, sw2, sw2 + GT * nhb, xb, c0,
                                        cn, m0, m1, n0, y, ldy);
                        continue;
                    }
                    uint8_t *tl = t.split ? tile + kc * CHUNK * GT : NULL;
                    if (tl)
                        gemm_split_tile(tile, tl, cn);
                    gemm_tile_rows(W, &t, tile, tl, sw, ow, xb, c0, cn, m0, m1, n0, y, ldy);
#else
                    gemm_tile_rows(W, &t, tile, sw, ow, xb, c0, cn, m0, m1, n0, y, ldy);
#endif
                }
            }
        }
        free(u);
        free(tile);
        free(so);
        free(sw);
    }
    free(xg);
    return 0;
}
#else
int wgemm_i8(const wdesc *W, const float *x, int64_t M, int64_t ldx, float *y, int64_t ldy,
             int nthreads)
{
    (void)W, (void)x, (void)M, (void)ldx, (void)y, (void)ldy, (void)nthreads;
    return -1;
}
#endif

/* From how many activation rows wmatmul with int8 activations runs the int8 GEMM on W instead of
 * the row kernels; 0: never (no GEMM in this build, or not for W). Each kind's crossover, 1B
 * shapes, 2 threads, Xeon with AVX-512 VNNI: q6_k's GEMM (per-16 scales, where the row kernels
 * are slowest) was 1.7x the row kernels' speed at 8 rows, q4_k's even at 12 and 2.1x at 32,
 * int8's 1.1x at 16, int4's (the fastest row kernels) 0.7x at 16, 1.4x at 24-32.
 * set_gemm_rows(n >= 0) puts n for every kind (kernels/cpu_ops.py: QSERVE_CPU_GEMM_ROWS). */
static int gemm_rows_forced = -1;

void set_gemm_rows(int rows)
{
    gemm_rows_forced = rows;
}

int gemm_min_rows(const wdesc *W)
{
#ifdef HAVE_I8_PATH
    gemm_traits t;
    if (gemm_traits_of(W, &t))
        return 0;
    if (gemm_rows_forced >= 0)
        return gemm_rows_forced;
#if defined(GEMM_VNNI)
    /* AVX-VNNI (QSERVE_CPU_ISA=avx2-vnni on a Sapphire Rapids VM, 2 threads, torch held to
     * AVX2, 8192 x 2048 and 2048 x 8192, GMAC/s of the GEMM against the row kernels at 8 / 12
     * / 16 rows): q4_k_x16 145, 141 / 154, 144 / 202, 182 against 144, 135 / 137, 133 / 142,
     * 134; int4_x16 153, 131 / 154, 140 against 147, 135 / 136, 128; int8 56, 49 / 74, 65
     * against 65, 65 / 67, 64; q6_k_x16 118, 103 against 88, 83; iq4_xs 114, 85 against 70,
     * 70; q5_k 105, 81 against 69, 66 */
    if (W->kind == KIND_Q4_K_X16 || W->kind == KIND_INT4_X16 || is_int4(W) ||
        W->kind == KIND_INT8)
        return 12;
    return 8;
#elif !defined(HAVE_ZMM_PATH)
    /* AVX2 (QSERVE_CPU_ISA=avx2 on a Zen 5, 2 threads, 2048 x 8192 and 8192 x 2048): the GEMM
     * against the row kernels at 8 / 16 / 24 / 32 rows, q4_k 0.81-0.82 / 1.07-1.13 / 1.16-1.26
     * / 1.21-1.28x, q6_k 0.83-0.88 / 0.98-1.17 / 1.14-1.27 / 1.24-1.43x, int4 0.64-0.69 /
     * 0.98-1.02 / 1.13-1.20 / 1.35-1.55x */
    /* the _x16 layouts (Zen 4 in the AVX2 build, 2 threads, the 1B's four shapes, the GEMM's
     * time over the row kernels' at 8 / 12 / 16 / 32 rows): q4_k_x16 0.88-1.07 / 0.99-1.03 /
     * 0.76-0.87 / 0.70-0.81, q6_k_x16 0.97-1.17 / 1.11-1.29 / 0.85-1.02 / 0.81-1.02, int4_x16
     * 0.77-0.97 / 0.89-0.91 / 0.72-0.77 / 0.59-0.72; between multiples of 8 the GEMM's time
     * steps with its 8-row groups, so 9-11 rows cost it as much as 12-16 */
    if (W->kind == KIND_Q4_K_X16 || W->kind == KIND_Q6_K_X16)
        return 16;
    if (W->kind == KIND_INT4_X16)
        return 12;
    /* 8-bit codes in two planes (Sapphire Rapids VM built for AVX2, 2 threads, the 1B's three
     * shapes, GMAC/s of the GEMM against the row kernels at 8 / 16 / 24 / 32 rows): int8
     * 34-38 / 54-57 / 65-74 / 73-81 against 66-70 / 66-69 / 65-70 / 67-71, iq4_xs 48-63 /
     * 72-86 / 82-96 / 90-102 against 66-74 / 66-73 / 67-72 / 71-73 */
    if (t.split)
        return W->kind == KIND_INT8 ? 24 : 16;
    return is_int4(W) || t.halves == 2 ? 20 : 16;
#else
    if (is_int4(W))
        return 20;
    if (W->kind == KIND_INT4_X16) /* its row kernel beats the GEMM at every decode size: 0.48 /
                                   * 1.23 / 1.43 ms against 0.94 / 1.37 / 1.58 at 8 / 24 / 32
                                   * rows (8192 x 2048, Zen 5, 2 threads); prefill keeps it */
        return 33;                /* above cpu_ops.py FUSED_MAX_ROWS: never at decode */
    if (W->kind == KIND_INT8)
        return 16;
    if (W->kind == KIND_Q4_K_X16) /* its row kernel holds up: 0.19 / 0.42 / 1.19 ms against the
                                   * GEMM's 0.77 / 0.77 / 1.20 at 2 / 8 / 24 rows (8192 x 2048,
                                   * Zen 5, 2 threads); at 32, 1.56 against 1.40 */
        return 24;
    if (W->kind == KIND_Q6_K_X16) /* 0.76 / 1.14 ms against 0.85 / 1.08 at 8 / 12 rows (2048 x
                                   * 8192); the GEMM 1.4-1.9x faster at 16-32 */
        return 12;
    return t.halves == 2 ? 8 : 12;
#endif
#else
    (void)W, (void)gemm_rows_forced;
    return 0;
#endif
}

/* Whether this build has the int8-activation kernels (AVX2); without them i8 is ignored. */
int has_int8_path(void)
{
#ifdef HAVE_I8_PATH
    return 1;
#else
    return 0;
#endif
}

/* Which row kernels this build runs: 2 the 512-bit ones (AVX-512 VNNI), 1 the 256-bit ones
 * (AVX2), 0 the portable loops. */
int kernel_isa(void)
{
#if defined(HAVE_ZMM_PATH)
    return 2;
#elif defined(HAVE_I8_PATH)
    return 1;
#else
    return 0;
#endif
}

/* Whether the int8 GEMM multiplies with vpdpbusd on ymm (AVX-VNNI, in a build without AVX-512) */
int gemm_vnni256(void)
{
#ifdef GEMM_VNNI
    return 1;
#else
    return 0;
#endif
}

/* Whether wmatmul/wdequant know this kind (kernels/cpu_ops.py supports asks). */
int wkind_known(int64_t kind)
{
#ifdef HAVE_I8_PATH
    if (kind == KIND_Q4_K_X16 || kind == KIND_Q6_K_X16 || kind == KIND_INT4_X16)
        return 1;
#endif
    return kind == KIND_F32 || kind == KIND_INT4 || kind == KIND_INT4Z || kind == KIND_INT8 ||
           kind == KIND_F16 || kind == KIND_BF16 || ggml_type_of(kind) != NULL;
}

/* out[b] = the index of the largest of x[b * ld .. b * ld + V), the first where several are
 * (torch.argmax's): a NaN counts as the largest, so the first NaN where there is one. Two passes
 * over a row: its maximum (and whether it holds a NaN), then the first element equal to it. */
void argmax_rows(const float *x, int64_t B, int64_t V, int64_t ld, int64_t *out)
{
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * ld;
        float mx = -INFINITY;
        int nan = 0;
        int64_t j = 0;
#ifdef HAVE_ATT_SIMD
        __m256 vm = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
        for (; j + 8 <= V; j += 8) {
            const __m256 v = _mm256_loadu_ps(r + j);
            vm = _mm256_max_ps(vm, v);
            un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        nan = _mm256_movemask_ps(un) != 0;
        mx = hmax(vm); /* (used only where no row value is NaN) */
#endif
        for (; j < V; j++) {
            nan |= r[j] != r[j];
            mx = r[j] > mx ? r[j] : mx;
        }
        int64_t best = 0;
        if (nan) {
            while (r[best] == r[best])
                best++;
        } else if (V > 0) {
            j = 0;
#ifdef HAVE_ATT_SIMD
            const __m256 m8 = _mm256_set1_ps(mx);
            for (; j + 8 <= V; j += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + j), m8,
                                                                 _CMP_EQ_OQ));
                if (hit)
                    break;
            }
#endif
            while (r[j] != mx)
                j++;
            best = j;
        }
        out[b] = best;
    }
}

/* ---- the fused decode step -------------------------------------------------------------------
 * Every decoder layer of a Llama-family model for one decode step (T tokens, one per sequence),
 * in one call, so Python is not on the per-layer path:
 *
 *     h = rmsnorm(x) * w_in;  qkv = h Wqkv^T;  rope(q, k);  write k, v;  a = attention(q)
 *     x += r a Wo^T;  h = rmsnorm(x) * w_post;  g, u = h Wgu^T;  x += r (silu(g) * u) Wdown^T
 *
 * (r: the layer's residual scale, 1 but in Granite; rope skipped in a layer without it.)
 *
 * Each layer is one dlayer (kernels/cpu_ops.py DLayer, built once from the model's tensors by
 * CpuDecoder). A linear's output rows may come in up to MAX_SEGMENTS row blocks of different
 * kinds (a Q4_K_M file's q/k in q4_k and v in q6_k), each writing its own columns:
 *
 *     y (T, N):  [ seg 0: N0 columns | seg 1: N1 columns | ... ]     N = N0 + N1 + ...
 */
#define MAX_SEGMENTS 3
typedef struct {
    int64_t nseg;
    wdesc seg[MAX_SEGMENTS]; /* in output order, each with its slice of the bias */
} wlinear;

typedef struct {
    const float *norm_in, *norm_post; /* (hidden,) */
    wlinear qkv, o, gate_up, down;
    kv_layer cache;
    int64_t rope; /* 0: this layer rotates nothing (SmolLM3's every fourth) */
    float residual; /* each sublayer's output is scaled by it before the add (Granite; else 1) */
} dlayer;

/* y (M, N) = x (M, K) W^T, W the linear's segments side by side. */
static void linear(const wlinear *L, const float *x, int64_t M, int64_t K, float *y, int64_t N,
                   int i8, int nthreads)
{
    for (int64_t s = 0, col = 0; s < L->nseg; col += L->seg[s].N, s++)
        wmatmul(&L->seg[s], x, M, K, y + col, N, i8, nthreads);
}

/* HF LlamaRMSNorm: w * (x / sqrt(mean(x^2) + eps)), fp32. */
static void rmsnorm(const float *x, const float *w, int64_t T, int64_t n, float eps, float *out)
{
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * n;
        float ss = 0.f;
        for (int64_t j = 0; j < n; j++)
            ss += xr[j] * xr[j];
        const float r = 1.f / sqrtf(ss / (float)n + eps);
        for (int64_t j = 0; j < n; j++)
            out[t * n + j] = w[j] * (xr[j] * r);
    }
}

/* Rotate-half rope on `heads` vectors of length d: x' = x cos + rotate_half(x) sin. */
static void rope(float *x, int64_t heads, int d, const float *cos, const float *sin)
{
    const int h = d / 2;
    for (int64_t i = 0; i < heads; i++) {
        float *v = x + i * d;
        for (int j = 0; j < h; j++) {
            const float a = v[j], b = v[j + h];
            v[j] = a * cos[j] - b * sin[j];
            v[j + h] = b * cos[j + h] + a * sin[j + h];
        }
    }
}

/* act[t, j] = silu(g) * u for gu[t] = (g[0..inter), u[0..inter)). */
static void silu_mul(const float *gu, int64_t T, int64_t inter, float *act, int nthreads)
{
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * inter >= 8192)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * inter, *u = g + inter;
        float *out = act + t * inter;
        int64_t j = 0;
#ifdef HAVE_ATT_SIMD
        const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
        for (; j + 8 <= inter; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp_ps(_mm256_xor_ps(gv, sign)); /* e^-g */
            _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                                    _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < inter; j++)
            out[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
}

void decode_layers(const dlayer *layers, int64_t num_layers, float *x, int64_t T,
                   int64_t hidden, int64_t H, int64_t hkv, int d, int64_t inter, float eps,
                   const int64_t *positions, const float *cos_table, const float *sin_table,
                   int kv_kind, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                   const int64_t *seq_lens, int64_t block_size, int64_t window, float scale,
                   const float *norm_final, int i8, int nthreads)
{
    const int64_t qs = H * d, kvs = hkv * d, qkv_n = qs + 2 * kvs;
    float *h = malloc(sizeof(float) * (size_t)(T * hidden));
    float *qkv = malloc(sizeof(float) * (size_t)(T * qkv_n));
    float *q = malloc(sizeof(float) * (size_t)(T * qs));
    float *k = malloc(sizeof(float) * (size_t)(T * kvs));
    float *v = malloc(sizeof(float) * (size_t)(T * kvs));
    float *att = malloc(sizeof(float) * (size_t)(T * qs));
    float *gu = malloc(sizeof(float) * (size_t)(T * 2 * inter));
    float *act = malloc(sizeof(float) * (size_t)(T * inter));
    float *o = malloc(sizeof(float) * (size_t)(T * hidden));
    for (int64_t l = 0; l < num_layers; l++) {
        const dlayer *L = layers + l;
        rmsnorm(x, L->norm_in, T, hidden, eps, h);
        linear(&L->qkv, h, T, hidden, qkv, qkv_n, i8, nthreads);
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * qkv_n;
            memcpy(q + t * qs, row, sizeof(float) * qs);
            memcpy(k + t * kvs, row + qs, sizeof(float) * kvs);
            memcpy(v + t * kvs, row + qs + kvs, sizeof(float) * kvs);
            if (!L->rope)
                continue;
            const float *c = cos_table + positions[t] * d, *s = sin_table + positions[t] * d;
            rope(q + t * qs, H, d, c, s);
            rope(k + t * kvs, hkv, d, c, s);
        }
        kv_write(kv_kind, k, v, slots, T, hkv, d, &L->cache, nthreads);
        paged_decode(kv_kind, q, att, T, H, hkv, d, &L->cache, tables, max_blocks, seq_lens,
                     block_size, scale, window, NULL, nthreads);
        linear(&L->o, att, T, qs, o, hidden, i8, nthreads);
        for (int64_t j = 0; j < T * hidden; j++)
            x[j] += L->residual * o[j];
        rmsnorm(x, L->norm_post, T, hidden, eps, h);
        linear(&L->gate_up, h, T, hidden, gu, 2 * inter, i8, nthreads);
        silu_mul(gu, T, inter, act, nthreads);
        linear(&L->down, act, T, inter, o, hidden, i8, nthreads);
        for (int64_t j = 0; j < T * hidden; j++)
            x[j] += L->residual * o[j];
    }
    if (norm_final) /* the model's last norm, in place (each row read before it is written) */
        rmsnorm(x, norm_final, T, hidden, eps, x);
    free(h); free(qkv); free(q); free(k); free(v); free(att); free(gu); free(act); free(o);
}

/* Block moves between KV pools (swap, layer-wise offload and staging): row src_idx[i] of src to
 * row dst_idx[i] of dst, rows of row_bytes bytes. Single-threaded on purpose: it runs in a copy
 * thread beside the compute threads, and a second OpenMP team there would fight them for cores. */
void copy_rows(const char *src, char *dst, const int64_t *src_idx, const int64_t *dst_idx,
               int64_t n, int64_t row_bytes)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + dst_idx[i] * row_bytes, src + src_idx[i] * row_bytes, (size_t)row_bytes);
}
