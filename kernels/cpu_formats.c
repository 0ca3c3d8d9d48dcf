/* Weight formats beyond qserve's int4/int8: GGML blocks read in place (q5_0, q5_1, q2_k .. q6_k,
 * iq4_nl, iq4_xs, mxfp4) and dense fp16/bf16. #included by cpu_ops.c after its int4/int8 kernels,
 * whose helpers (hsum, lane, qacts, quantize_activations, FOR_EACH_*) these share; wmatmul and
 * wdequant there switch on the kind and land here.
 *
 * Block layouts (little-endian; d, dmin, m fp16; gguf-py's dequantization is the reference that
 * qserve/formats/ggml.py mirrors):
 *
 *   q5_0  32 inputs,  22 B  d | qh[4] | qs[16]                 w = d (q - 16)
 *   q5_1  32 inputs,  24 B  d | m | qh[4] | qs[16]             w = d q + m
 *   q2_k  256 inputs, 84 B  sm[16] | qs[64] | d | dmin         w = d sc_s q - dmin m_s
 *   q3_k  256,       110 B  hmask[32] | qs[64] | sc[12] | d    w = d sc_s (q - 4)
 *   q4_k  256,       144 B  d | dmin | sc[12] | qs[128]        w = d sc_j q - dmin m_j
 *   q5_k  256,       176 B  d | dmin | sc[12] | qh[32] | qs[128]    (as q4_k, 5-bit q)
 *   q6_k  256,       210 B  ql[128] | qh[64] | sc[16] | d      w = d sc_s (q - 32)
 *   iq4_nl  32,       18 B  d | qs[16]                         w = d v[q]
 *   iq4_xs  256,     136 B  d | sh (uint16) | sl[4] | qs[128]  w = d (ls_j - 32) v[q]
 *   mxfp4   32,       17 B  e (E8M0) | qs[16]                  w = 2^(e - 128) v4[q]
 *
 * s = i / 16 and j = i / 32 index sub-blocks of a super-block; q2_k's byte sm[s] holds sc_s (low
 * nibble) and m_s (high); q3_k's 12 bytes hold 16 6-bit scales biased by 32 (k3_words), q4_k's
 * and q5_k's 8 6-bit scales and 8 mins (k4_words); q6_k's scales are int8. Where input i's code
 * bits sit, writing i = 128 h + 32 t + l (h < 2, t < 4, l < 32):
 *
 *   q5_0/q5_1  low 4: nibble (i >= 16) of qs[i % 16]; bit 4: bit i of qh
 *   q2_k/q3_k  low 2: bits 2t, 2t + 1 of qs[32 h + l]; q3_k bit 2: bit 4h + t of hmask[l]
 *   q4_k/q5_k  each 32 bytes of qs hold two sub-blocks, low nibbles then high: i = 64 p + 32 u
 *              + l (p < 4, u < 2) is nibble u of qs[32 p + l]; q5_k bit 4: bit i / 32 of qh[l]
 *   q6_k       low 4: nibble (t >= 2) of ql[64 h + 32 (t % 2) + l]; high 2: bits 2t, 2t + 1 of
 *              qh[32 h + l]
 *   iq4_*      an index into the table v of 16 int8 values (IQ4_VALUES): nibble (i % 32 >= 16)
 *              of qs[16 j + i % 16]; iq4_xs's 6-bit ls_j: nibble j % 2 of sl[j / 2], bits 2j,
 *              2j + 1 of sh above it
 *   mxfp4      as iq4_nl's, into v4 (MXFP4_VALUES: E2M1's values doubled, so the scale is
 *              halved: 2^(e - 127) / 2)
 *
 * Every type has a block decoder, used by wdequant, by the fp32-activation path (decode a block
 * into floats, then dot it with every activation row) and on machines without AVX2. It does the
 * reference's arithmetic (scale products d sc, dmin m first, exact in fp32 for 11-bit fp16
 * mantissas times 8-bit scales; then one multiply-add per weight), so its weights are gguf-py's
 * bit for bit. With AVX2 each type also has an int8-activation row kernel (below). */

#define QK_K 256 /* inputs per K-quant super-block */

static inline float ld_half(const uint8_t *p)
{
    half h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* q4_k/q5_k: 12 bytes -> 4 words holding bytes [8 scales, 8 mins], all 6-bit. Bytes 0-3 hold
 * scales 0-3 (bits 0-5) and the top bits of scales 4-7, bytes 4-7 mins 0-3 and the top bits of
 * mins 4-7, bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high). */
static inline void k4_words(const uint8_t *p, uint32_t w[4])
{
    uint32_t a, b, c;
    memcpy(&a, p, 4);
    memcpy(&b, p + 4, 4);
    memcpy(&c, p + 8, 4);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, top = 0x30303030;
    w[0] = a & six;
    w[1] = (c & four) | ((a >> 2) & top);
    w[2] = b & six;
    w[3] = ((c >> 4) & four) | ((b >> 2) & top);
}

/* q3_k: 12 bytes -> 4 words holding its 16 scales + 32 as bytes. Bytes 0-7 hold the low nibbles
 * (scales 0-7 low, 8-15 high), bytes 8-11 the top 2 bits (scale s: bits 2 (s / 4) of byte
 * 8 + s % 4). */
static inline void k3_words(const uint8_t *p, uint32_t w[4])
{
    uint32_t a, b, c;
    memcpy(&a, p, 4);
    memcpy(&b, p + 4, 4);
    memcpy(&c, p + 8, 4);
    const uint32_t four = 0x0f0f0f0f, two = 0x03030303;
    w[0] = (a & four) | ((c & two) << 4);
    w[1] = (b & four) | (((c >> 2) & two) << 4);
    w[2] = ((a >> 4) & four) | (((c >> 4) & two) << 4);
    w[3] = ((b >> 4) & four) | (((c >> 6) & two) << 4);
}

/* ---- block decoders: one block -> its block floats ------------------------------------------ */

static void deq_q5(const uint8_t *b, float *y, const int asym)
{
    const float d = ld_half(b), m = asym ? ld_half(b + 2) : -16.f * d;
    uint32_t qh;
    memcpy(&qh, b + (asym ? 4 : 2), 4);
    const uint8_t *qs = b + (asym ? 8 : 6);
    for (int l = 0; l < 16; l++) {
        y[l] = d * (float)((qs[l] & 15) | ((qh >> l) & 1) << 4) + m;
        y[l + 16] = d * (float)((qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4) + m;
    }
}
static void deq_q5_0(const uint8_t *b, float *y) { deq_q5(b, y, 0); }
static void deq_q5_1(const uint8_t *b, float *y) { deq_q5(b, y, 1); }

static void deq_q2_k(const uint8_t *b, float *y)
{
    const uint8_t *sm = b, *qs = b + 16;
    const float d = ld_half(b + 80), dmin = ld_half(b + 82);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int half16 = 0; half16 < 2; half16++) {
                const int s = 8 * h + 2 * t + half16;
                const float dl = d * (float)(sm[s] & 15), ml = dmin * (float)(sm[s] >> 4);
                for (int l = 16 * half16; l < 16 * half16 + 16; l++)
                    y[128 * h + 32 * t + l] = dl * (float)((qs[32 * h + l] >> (2 * t)) & 3) - ml;
            }
}

static void deq_q3_k(const uint8_t *b, float *y)
{
    const uint8_t *hm = b, *qs = b + 32;
    const float d = ld_half(b + 108);
    uint32_t w[4];
    uint8_t sc[16]; /* scale + 32 */
    k3_words(b + 96, w);
    memcpy(sc, w, 16);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int half16 = 0; half16 < 2; half16++) {
                const float dl = d * (float)(sc[8 * h + 2 * t + half16] - 32);
                for (int l = 16 * half16; l < 16 * half16 + 16; l++) {
                    const int q = ((qs[32 * h + l] >> (2 * t)) & 3)
                                  | ((hm[l] >> (4 * h + t)) & 1) << 2;
                    y[128 * h + 32 * t + l] = dl * (float)(q - 4);
                }
            }
}

static __attribute__((unused)) void deq_k4(const uint8_t *b, float *y, const int five)
{
    const float d = ld_half(b), dmin = ld_half(b + 2);
    uint32_t w[4];
    uint8_t sm[16];
    k4_words(b + 4, w);
    memcpy(sm, w, 16);
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        const float dl = d * (float)sm[j], ml = dmin * (float)sm[8 + j];
        const uint8_t *q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            const int hi = five ? ((qh[l] >> j) & 1) << 4 : 0;
            y[32 * j + l] = dl * (float)(((q[l] >> (4 * (j & 1))) & 15) | hi) - ml;
        }
    }
}
#ifdef HAVE_I8_PATH
/* 32 codes (bytes) c -> y[0..32) = dl * c + off, c unsigned (or signed: sgn) */
static inline void deq32(__m256i c, const int sgn, float dl, float off, float *y)
{
    const __m256 vd = _mm256_set1_ps(dl), vo = _mm256_set1_ps(off);
    const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256i v = sgn ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
        _mm256_storeu_ps(y + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), vd, vo));
    }
}

static void codes_k4(const uint8_t *b, uint8_t *u, float *s, float *o, const int five);
static void codes_q6_k(const uint8_t *b, uint8_t *u, float *s, float *o);

/* deq_k4 with AVX2, through the block's codes (codes_k4): the same products (d sc and dmin m
 * exact in fp32, then one fma each, which is what the scalar loop compiles to), so the same
 * floats bit for bit */
static void deq_k4_simd(const uint8_t *b, float *y, const int five)
{
    uint8_t u[QK_K] __attribute__((aligned(32)));
    float s[QK_K / 16], o[QK_K / 16];
    codes_k4(b, u, s, o, five);
    for (int j = 0; j < 8; j++)
        deq32(_mm256_load_si256((const __m256i *)(u + 32 * j)), 0, s[2 * j], o[2 * j],
              y + 32 * j);
}
static void deq_q4_k(const uint8_t *b, float *y) { deq_k4_simd(b, y, 0); }
static void deq_q5_k(const uint8_t *b, float *y) { deq_k4_simd(b, y, 1); }
#else
static void deq_q4_k(const uint8_t *b, float *y) { deq_k4(b, y, 0); }
static void deq_q5_k(const uint8_t *b, float *y) { deq_k4(b, y, 1); }
#endif

static __attribute__((unused)) void deq_q6_k_scalar(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = ld_half(b + 208);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int half16 = 0; half16 < 2; half16++) {
                const float dl = d * (float)sc[8 * h + 2 * t + half16];
                for (int l = 16 * half16; l < 16 * half16 + 16; l++) {
                    const int lo = (ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15;
                    const int q = lo | ((qh[32 * h + l] >> (2 * t)) & 3) << 4;
                    y[128 * h + 32 * t + l] = dl * (float)(q - 32);
                }
            }
}

#ifdef HAVE_I8_PATH
/* deq_q6_k_scalar with AVX2, through the block's codes (codes_q6_k): u s - 32 s in one fma is
 * d sc (q - 32) rounded once, as the scalar product is (32 s is exact), so the same floats */
static void deq_q6_k(const uint8_t *b, float *y)
{
    uint8_t u[QK_K] __attribute__((aligned(32)));
    float s[QK_K / 16], o[QK_K / 16];
    codes_q6_k(b, u, s, o);
    for (int j = 0; j < QK_K / 16; j++) {
        const __m128i c = _mm_load_si128((const __m128i *)(u + 16 * j));
        const __m256 vs = _mm256_set1_ps(s[j]), vo = _mm256_set1_ps(-32.f * s[j]);
        _mm256_storeu_ps(y + 16 * j, _mm256_fmadd_ps(u8_to_ps(c), vs, vo));
        _mm256_storeu_ps(y + 16 * j + 8, _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(c, 8)), vs, vo));
    }
}
#else
static void deq_q6_k(const uint8_t *b, float *y) { deq_q6_k_scalar(b, y); }
#endif

/* iq4_nl / iq4_xs / mxfp4: the tables, and each 32 inputs' values from their 16 bytes */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* mxfp4's E8M0 byte e -> 2^(e - 128), as gguf-py and ggml_e8m0_to_fp32_half build it: e < 2
 * the subnormals 2^-128, 2^-127; e = 255 is 2^127 (no NaN) */
static inline float e8m0_half(uint8_t e)
{
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline int iq4_xs_scale(const uint8_t *b, int j) /* ls_j - 32 */
{
    const int sh = b[2] | b[3] << 8;
    return (((b[4 + j / 2] >> (4 * (j % 2))) & 15) | ((sh >> (2 * j)) & 3) << 4) - 32;
}

/* the 32 inputs' values in table v, low nibbles then high (one vpshufb) */
#ifdef HAVE_I8_PATH
static inline __m256i table_values_y(const int8_t *v, const uint8_t *qs)
{
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(15);
    const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4),
                                         _mm_and_si128(q, m4));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)v)),
                               idx);
}
#endif

static void deq_table_32(const int8_t *v, const uint8_t *qs, float dl, float *y)
{
#ifdef HAVE_I8_PATH
    const __m256i vals = table_values_y(v, qs);
    const __m256 d = _mm256_set1_ps(dl);
    for (int k = 0; k < 4; k++) { /* dl v: one product, as the reference's */
        const __m128i part = k < 2 ? _mm256_castsi256_si128(vals)
                                   : _mm256_extracti128_si256(vals, 1);
        const __m256i w = _mm256_cvtepi8_epi32(k % 2 ? _mm_srli_si128(part, 8) : part);
        _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(w)));
    }
#else
    for (int l = 0; l < 16; l++) {
        y[l] = dl * (float)v[qs[l] & 15];
        y[l + 16] = dl * (float)v[qs[l] >> 4];
    }
#endif
}

static void deq_iq4_nl(const uint8_t *b, float *y)
{
    deq_table_32(IQ4_VALUES, b + 2, ld_half(b), y);
}

static void deq_iq4_xs(const uint8_t *b, float *y)
{
    const float d = ld_half(b);
    for (int j = 0; j < QK_K / 32; j++) /* d (ls - 32): exact in fp32, as gguf-py's dl */
        deq_table_32(IQ4_VALUES, b + 8 + 16 * j, d * (float)iq4_xs_scale(b, j), y + 32 * j);
}

static void deq_mxfp4(const uint8_t *b, float *y)
{
    deq_table_32(MXFP4_VALUES, b + 1, e8m0_half(b[0]), y);
}

/* ---- block codes: one block -> its unsigned codes and per-16 scales, for the int8 GEMM -------
 * The GEMM (wgemm_i8 in cpu_ops.c) multiplies the weights' own integer codes, not a rounding of
 * their values: per block, u[i] the code of input i as an unsigned byte in input order, and per
 * 16 inputs a scale s and an offset o with
 *
 *     w_i = s (u_i - z) + o      (z the type's zero point, ggml_type.z: an integer)
 *
 * which is the reference's value exactly (the same products d sc, dmin m, exact in fp32), so
 * nothing is rounded a second time. Types with one scale per 32 inputs give equal halves. */
static void codes_q5(const uint8_t *b, uint8_t *u, float *s, float *o, const int asym)
{
    const float d = ld_half(b), m = asym ? ld_half(b + 2) : 0.f;
    uint32_t qh;
    memcpy(&qh, b + (asym ? 4 : 2), 4);
    const uint8_t *qs = b + (asym ? 8 : 6);
    for (int l = 0; l < 16; l++) {
        u[l] = (uint8_t)((qs[l] & 15) | ((qh >> l) & 1) << 4);
        u[l + 16] = (uint8_t)((qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4);
    }
    s[0] = s[1] = d;
    o[0] = o[1] = m;
}
static void codes_q5_0(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    codes_q5(b, u, s, o, 0);
}
static void codes_q5_1(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    codes_q5(b, u, s, o, 1);
}

static void codes_q2_k(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    const uint8_t *sm = b, *qs = b + 16;
    const float d = ld_half(b + 80), dmin = ld_half(b + 82);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++)
                u[128 * h + 32 * t + l] = (qs[32 * h + l] >> (2 * t)) & 3;
    for (int j = 0; j < 16; j++) { /* sub-block j = inputs 16j .. 16j + 15 */
        s[j] = d * (float)(sm[j] & 15);
        o[j] = -(dmin * (float)(sm[j] >> 4));
    }
}

static void codes_q3_k(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    const uint8_t *hm = b, *qs = b + 32;
    const float d = ld_half(b + 108);
    uint32_t w[4];
    uint8_t sc[16];
    k3_words(b + 96, w);
    memcpy(sc, w, 16);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++)
                u[128 * h + 32 * t + l] = (uint8_t)(((qs[32 * h + l] >> (2 * t)) & 3)
                                                    | ((hm[l] >> (4 * h + t)) & 1) << 2);
    for (int j = 0; j < 16; j++) {
        s[j] = d * (float)(sc[j] - 32);
        o[j] = 0.f;
    }
}

static void codes_k4(const uint8_t *b, uint8_t *u, float *s, float *o, const int five)
{
    const float d = ld_half(b), dmin = ld_half(b + 2);
    uint32_t w[4];
    uint8_t sm[16];
    k4_words(b + 4, w);
    memcpy(sm, w, 16);
    const uint8_t *qs = b + (five ? 48 : 16);
#ifdef HAVE_I8_PATH
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (five) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                                         _mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
            qh = _mm256_srli_epi16(qh, 2);
        }
        _mm256_storeu_si256((__m256i *)(u + 64 * p), lo);
        _mm256_storeu_si256((__m256i *)(u + 64 * p + 32), hi);
    }
#else
    const uint8_t *qh = b + 16;
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 32; l++)
            u[32 * j + l] = (uint8_t)(((qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 15)
                                      | (five ? ((qh[l] >> j) & 1) << 4 : 0));
#endif
    for (int j = 0; j < 8; j++) {
        s[2 * j] = s[2 * j + 1] = d * (float)sm[j];
        o[2 * j] = o[2 * j + 1] = -(dmin * (float)sm[8 + j]);
    }
}
static void codes_q4_k(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    codes_k4(b, u, s, o, 0);
}
static void codes_q5_k(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    codes_k4(b, u, s, o, 1);
}

static void codes_q6_k(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = ld_half(b + 208);
#ifdef HAVE_I8_PATH
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
#define Q6(lo, hi) _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(hi, m30))
        uint8_t *uh = u + 128 * h;
        _mm256_storeu_si256((__m256i *)uh, Q6(l0, _mm256_slli_epi16(hb, 4)));
        _mm256_storeu_si256((__m256i *)(uh + 32), Q6(l1, _mm256_slli_epi16(hb, 2)));
        _mm256_storeu_si256((__m256i *)(uh + 64), Q6(_mm256_srli_epi16(l0, 4), hb));
        _mm256_storeu_si256((__m256i *)(uh + 96),
                            Q6(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(hb, 2)));
#undef Q6
    }
#else
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++)
                u[128 * h + 32 * t + l] = (uint8_t)(
                    ((ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15)
                    | ((qh[32 * h + l] >> (2 * t)) & 3) << 4);
#endif
    for (int j = 0; j < 16; j++) {
        s[j] = d * (float)sc[j];
        o[j] = 0.f;
    }
}

/* iq4_*: the table values v + 128 as codes (z = 128, 1 .. 241), the block's d or d (ls - 32) as
 * the scale: s (u - z) = d v exactly. Past 2 * 127 * 127 a pair of products saturates int16, so
 * the AVX2 GEMM leaves them to the row kernels (gemm_run); vpdpbusd does not saturate. */
static void codes_iq4_32(const uint8_t *qs, uint8_t *u)
{
#ifdef HAVE_I8_PATH
    _mm256_storeu_si256((__m256i *)u, _mm256_xor_si256(table_values_y(IQ4_VALUES, qs), /* + 128 */
                                                       _mm256_set1_epi8((char)0x80)));
#else
    for (int l = 0; l < 16; l++) {
        u[l] = (uint8_t)(IQ4_VALUES[qs[l] & 15] + 128);
        u[l + 16] = (uint8_t)(IQ4_VALUES[qs[l] >> 4] + 128);
    }
#endif
}

static void codes_iq4_nl(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    codes_iq4_32(b + 2, u);
    s[0] = s[1] = ld_half(b);
    o[0] = o[1] = 0.f;
}

static void codes_iq4_xs(const uint8_t *b, uint8_t *u, float *s, float *o)
{
    const float d = ld_half(b);
    for (int j = 0; j < QK_K / 32; j++) {
        codes_iq4_32(b + 8 + 16 * j, u + 32 * j);
        s[2 * j] = s[2 * j + 1] = d * (float)iq4_xs_scale(b, j);
        o[2 * j] = o[2 * j + 1] = 0.f;
    }
}

/* mxfp4: the table values v4 + 12 as codes (z = 12, 0 .. 24: a 5-bit code's range, which the
 * AVX2 GEMM multiplies whole), 2^(e - 128) as the scale: s (u - z) = 2^(e - 128) v4 exactly */
static void codes_mxfp4(const uint8_t *b, uint8_t *u, float *s, float *o)
{
#ifdef HAVE_I8_PATH
    _mm256_storeu_si256((__m256i *)u, _mm256_add_epi8(table_values_y(MXFP4_VALUES, b + 1),
                                                      _mm256_set1_epi8(12)));
#else
    for (int l = 0; l < 16; l++) {
        u[l] = (uint8_t)(MXFP4_VALUES[b[1 + l] & 15] + 12);
        u[l + 16] = (uint8_t)(MXFP4_VALUES[b[1 + l] >> 4] + 12);
    }
#endif
    s[0] = s[1] = e8m0_half(b[0]);
    o[0] = o[1] = 0.f;
}

/* ---- int8-activation row kernels -------------------------------------------------------------
 * As q4_row_i8, against the same activations (quantize_activations: int8 codes with one step d_x
 * per 32 inputs). A weight row's codes are unpacked once per 32-input chunk and multiplied with
 * every activation row's codes by _mm256_maddubs_epi16 (unsigned codes, or |code| against x
 * with the code's sign: the int16 pair sums stay below 2 * 63 * 127 < 32767);
 * _mm256_madd_epi16 then weighs the pair sums by the integer sub-block scales, for 16-input
 * sub-blocks with a vector holding sc_2c in its low 128-bit lane and sc_2c+1 in the high one
 * (two sub-blocks in one step). The chunk's total is converted once and scaled by d_w d_x:
 *
 *   sum_i w_i x_i ~ sum_c d_w d_x,c sum_s sc_s sum_{i in s} q_i q_x,i  -  sum_s o_s d_x S_s
 *
 * Code offsets are taken into signed codes (q6_k q - 32, q3_k q - 4); the mins o_s = dmin m_s
 * (q2_k, q4_k, q5_k) and q5's offsets multiply the activation sums S_s = sum_{i in s} q_x,i, 8
 * rows at once. One step per 32 inputs keeps the activations as precise as the int4 path's. A
 * step per 256 (llama.cpp's q8_K: a super-block then adds up in int32) ran ~1.3x faster at 8
 * rows with the weights in cache, but raised the KL divergence from fp32 activations ~1.6x
 * (SmolLM2-135M Q6_K, 1016 teacher-forced tokens: 0.0058 against 0.0035; perplexity +1.3%
 * against -0.2%). */
#ifdef HAVE_I8_PATH

/* The mt rows' dot products with chunk c of a weight row, codes (32 unsigned bytes) weighed by
 * the int16 scales sc, into acc[i] scaled by lane i of sd (d_w d_x of the rows). */
static inline __attribute__((always_inline)) void
chunk_dot(__m256 *acc, __m256i codes, __m256i sc, __m256 sd, const qacts *a, int64_t m0,
          int64_t K, int64_t c, const int mt)
{
    for (int i = 0; i < mt; i++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + i) * K + c * 32));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), sc);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), lane(sd, i), acc[i]);
    }
}

/* chunk_dot for signed codes w (-128 < w < 128): maddubs takes |w| and x with w's sign */
static inline __attribute__((always_inline)) void
chunk_dot_signed(__m256 *acc, __m256i w, __m256i sc, __m256 sd, const qacts *a, int64_t m0,
                 int64_t K, int64_t c, const int mt)
{
    const __m256i aw = _mm256_sign_epi8(w, w);
    for (int i = 0; i < mt; i++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + i) * K + c * 32));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), sc);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), lane(sd, i), acc[i]);
    }
}

/* d times the 8 rows' activation steps of chunk c */
static inline __m256 chunk_step(float d, const qacts *a, int64_t m0, int64_t c)
{
    return _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(a->d + c * a->Mp + m0));
}

/* the 8 rows' d_x sum q_x over chunk c (32 inputs), or over 16-input sub-block s */
#define SUM32(c) _mm256_loadu_ps(a->dsum + (c) * a->Mp + m0)
#define SUM16(s) _mm256_loadu_ps(a->dsum16 + (s) * a->Mp + m0)

/* int16 element j (< 8) of each 128-bit lane of v, in all of that lane */
static inline __m256i pick16(__m256i v, int j)
{
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)((2 * j + 1) << 8 | 2 * j)));
}

/* Per-16 scales of 32-input chunk t (< 4) from s8, 8 int16 scales in both 128-bit lanes:
 * scale 2t in the low lane, 2t + 1 in the high one. */
static inline __m256i chunk_scales(__m256i s8, int t)
{
    const __m128i lo = _mm_set1_epi16((short)((4 * t + 1) << 8 | 4 * t));
    const __m128i hi = _mm_set1_epi16((short)((4 * t + 3) << 8 | (4 * t + 2)));
    return _mm256_shuffle_epi8(s8, _mm256_set_m128i(hi, lo));
}

/* bit b of each of 32 bytes -> 0x10 where it is set: the high code bit of q5_0/q5_1 */
static inline __m256i q5_high_bits(const uint8_t *p)
{
    uint32_t h;
    memcpy(&h, p, 4);
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), pick), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

/* res[i] = the rows' sums: acc[i]'s lanes, plus lane i of off (8 rows' offset terms) */
static inline __attribute__((always_inline)) void
finish_rows(const __m256 *acc, __m256 off, const int mt, float *res)
{
    float offs[MTI];
    _mm256_storeu_ps(offs, off);
    for (int i = 0; i < mt; i++)
        res[i] = hsum(acc[i]) + offs[i];
}

/* q5_0 / q5_1: one 32-input block per chunk, codes 0..31 */
static inline __attribute__((always_inline)) void
q5_row_i8(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int asym,
          const int mt, float *res)
{
    __m256 acc[MTI], off = _mm256_setzero_ps();
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * (asym ? 24 : 22), *qh = blk + (asym ? 4 : 2);
        prefetch_ahead(blk, 1);
        const float d = ld_half(blk), o = asym ? ld_half(blk + 2) : -16.f * d;
        const __m128i q4 = _mm_loadu_si128((const __m128i *)(qh + 4));
        const __m256i w = _mm256_or_si256(
            _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q4, 4), q4), mask), q5_high_bits(qh));
        off = _mm256_fmadd_ps(_mm256_set1_ps(o), SUM32(b), off);
        chunk_dot(acc, w, ones, chunk_step(d, a, m0, b), a, m0, K, b, mt);
    }
    finish_rows(acc, off, mt, res);
}

/* q4_k / q5_k: 32-input sub-blocks, each with a 6-bit scale (in madd) and min */
static inline __attribute__((always_inline)) void
k4_row_i8(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int five,
          const int mt, float *res)
{
    __m256 acc[MTI], off[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * (five ? 176 : 144), *qs = blk + (five ? 48 : 16);
        prefetch_ahead(blk, five ? 176 : 144);
        uint32_t wd[4]; /* in registers: a store and a 16-byte reload would stall */
        k4_words(blk + 4, wd);
        const __m128i sm8 = _mm_setr_epi32((int)wd[0], (int)wd[1], (int)wd[2], (int)wd[3]);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm8)); /* 8 scales */
        const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(-ld_half(blk + 2)), /* -dmin m_j */
                                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                              _mm_unpackhi_epi64(sm8, sm8))));
        const float d = ld_half(blk);
        __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                          : _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) { /* 64 inputs: sub-blocks 2p (low nibbles), 2p + 1 (high) */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            __m256i lo = _mm256_and_si256(q, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                                             _mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
                qh = _mm256_srli_epi16(qh, 2);
            }
            for (int u = 0; u < 2; u++) {
                const int j = 2 * p + u;
                const int64_t c = 8 * b + j;
                off[u] = _mm256_fmadd_ps(lane(mins, j), SUM32(c), off[u]);
                chunk_dot(acc, u ? hi : lo, pick16(sc, j), chunk_step(d, a, m0, c), a, m0, K, c,
                          mt);
            }
        }
    }
    finish_rows(acc, _mm256_add_ps(off[0], off[1]), mt, res);
}

/* q6_k: 16-input sub-blocks with int8 scales; codes are q + 32, taken as signed q */
static inline __attribute__((always_inline)) void
q6k_row_i8(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int mt,
           float *res)
{
    __m256 acc[MTI];
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i z = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 210, *ql = blk, *qh = blk + 128;
        prefetch_ahead(blk, 210);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = ld_half(blk + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i s8 = _mm256_broadcastsi128_si256(
                _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * h))));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            /* low nibble | 2 high bits moved to bits 4-5, minus 32, for chunks t = 0..3 */
#define Q6(lo, hi) \
    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(hi, m30)), z)
            const __m256i q[4] = {Q6(l0, _mm256_slli_epi16(hb, 4)),
                                  Q6(l1, _mm256_slli_epi16(hb, 2)),
                                  Q6(_mm256_srli_epi16(l0, 4), hb),
                                  Q6(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(hb, 2))};
#undef Q6
            for (int t = 0; t < 4; t++) {
                const int64_t c = 8 * b + 4 * h + t;
                chunk_dot_signed(acc, q[t], chunk_scales(s8, t), chunk_step(d, a, m0, c), a, m0,
                                 K, c, mt);
            }
        }
    }
    finish_rows(acc, _mm256_setzero_ps(), mt, res);
}

/* q3_k: 16-input sub-blocks with 6-bit signed scales; codes are q + 4, taken as signed q */
static inline __attribute__((always_inline)) void
q3k_row_i8(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int mt,
           float *res)
{
    __m256 acc[MTI];
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), z = _mm256_set1_epi8(4);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 110, *qs = blk + 32;
        prefetch_ahead(blk, 110);
        uint32_t wd[4]; /* in registers: a store and a 16-byte reload would stall */
        k3_words(blk + 96, wd);
        const __m128i sc8 = _mm_sub_epi8(
            _mm_setr_epi32((int)wd[0], (int)wd[1], (int)wd[2], (int)wd[3]), _mm_set1_epi8(32));
        const float d = ld_half(blk + 108);
        __m256i hm = _mm256_loadu_si256((const __m256i *)blk); /* bit 4h + t: chunk t of half h */
        for (int h = 0; h < 2; h++) {
            const __m256i s8 = _mm256_broadcastsi128_si256(
                _mm_cvtepi8_epi16(h ? _mm_unpackhi_epi64(sc8, sc8) : sc8));
            __m256i qv = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int t = 0; t < 4; t++) {
                const __m256i q = _mm256_or_si256(_mm256_and_si256(qv, m3),
                                                  _mm256_slli_epi16(_mm256_and_si256(hm, one), 2));
                qv = _mm256_srli_epi16(qv, 2);
                hm = _mm256_srli_epi16(hm, 1);
                const int64_t c = 8 * b + 4 * h + t;
                chunk_dot_signed(acc, _mm256_sub_epi8(q, z), chunk_scales(s8, t),
                                 chunk_step(d, a, m0, c), a, m0, K, c, mt);
            }
        }
    }
    finish_rows(acc, _mm256_setzero_ps(), mt, res);
}

/* q2_k: 16-input sub-blocks with 4-bit scales and mins, codes 0..3 */
static inline __attribute__((always_inline)) void
q2k_row_i8(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int mt,
           float *res)
{
    __m256 acc[MTI], off[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 84, *qs = blk + 16;
        prefetch_ahead(blk, 84);
        const __m128i sm = _mm_loadu_si128((const __m128i *)blk);
        const __m128i sc = _mm_and_si128(sm, m4), mn = _mm_and_si128(_mm_srli_epi16(sm, 4), m4);
        const float d = ld_half(blk + 80), dmin = ld_half(blk + 82);
        for (int h = 0; h < 2; h++) {
            const __m256i s8 = _mm256_broadcastsi128_si256(
                _mm_cvtepu8_epi16(h ? _mm_unpackhi_epi64(sc, sc) : sc));
            const __m256 coef = _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(h ? _mm_unpackhi_epi64(mn, mn) : mn)));
            __m256i qv = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int t = 0; t < 4; t++) {
                const __m256i q = _mm256_and_si256(qv, m3);
                qv = _mm256_srli_epi16(qv, 2);
                const int64_t c = 8 * b + 4 * h + t; /* sub-blocks 2c, 2c + 1: two fma chains */
                off[0] = _mm256_fmadd_ps(lane(coef, 2 * t), SUM16(2 * c), off[0]);
                off[1] = _mm256_fmadd_ps(lane(coef, 2 * t + 1), SUM16(2 * c + 1), off[1]);
                chunk_dot(acc, q, chunk_scales(s8, t), chunk_step(d, a, m0, c), a, m0, K, c, mt);
            }
        }
    }
    finish_rows(acc, _mm256_add_ps(off[0], off[1]), mt, res);
}

/* iq4_nl / iq4_xs: per 32 inputs the table's values (one vpshufb of the 16 indices, low
 * nibbles then high), signed; iq4_xs's ls - 32 weighs the pairs in madd, its d and iq4_nl's
 * scale the step */
static inline __attribute__((always_inline)) void
iq4_row_i8(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int xs,
           const int mt, float *res)
{
    __m256 acc[MTI];
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    const int bytes = xs ? 136 : 18, subs = xs ? QK_K / 32 : 1;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bytes, *qs = blk + (xs ? 8 : 2);
        prefetch_ahead(blk, bytes);
        const float d = ld_half(blk);
        for (int j = 0; j < subs; j++) {
            const __m256i sc = _mm256_set1_epi16((short)(xs ? iq4_xs_scale(blk, j) : 1));
            const int64_t c = (int64_t)subs * b + j;
            chunk_dot_signed(acc, table_values_y(IQ4_VALUES, qs + 16 * j), sc,
                             chunk_step(d, a, m0, c), a, m0, K, c, mt);
        }
    }
    finish_rows(acc, _mm256_setzero_ps(), mt, res);
}

/* mxfp4: as iq4_nl, its table's values (|v| <= 12) signed, the block's 2^(e - 128) times the
 * rows' steps scaling each chunk (llama.cpp's vec_dot_mxfp4_q8_0, with a step per 32 inputs) */
static inline __attribute__((always_inline)) void
mxfp4_row_i8(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int mt,
             float *res)
{
    __m256 acc[MTI];
    for (int i = 0; i < mt; i++)
        acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 17;
        prefetch_ahead(blk, 17);
        chunk_dot_signed(acc, table_values_y(MXFP4_VALUES, blk + 1), ones,
                         chunk_step(e8m0_half(blk[0]), a, m0, b), a, m0, K, b, mt);
    }
    finish_rows(acc, _mm256_setzero_ps(), mt, res);
}
#undef SUM32
#undef SUM16

#ifdef HAVE_ZMM_PATH
/* q4_k / q5_k, 512-bit (AVX-512 VNNI): as q4_row_z, two 32-input sub-blocks per step (one
 * 32-byte load of qs unpacks sub-blocks 2p and 2p + 1: low nibbles, then high), 16 sub-blocks
 * (two super-blocks) per block of scale vectors: lane j of s16 is d sc_j, of o16 -dmin m_j,
 * times the activation rows' steps and sums of their chunk. */
static inline __attribute__((always_inline)) void
k4_row_z(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int five,
         const int mt, float *res)
{
    const int64_t nchunk = K / CHUNK, bytes = five ? 176 : 144;
    __m512 acc[MTI];
    float sd[MTI][16] __attribute__((aligned(64)));
    for (int i = 0; i < mt; i++)
        acc[i] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    const __m512i shifts = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    for (int64_t b0 = 0; b0 < nb; b0 += 2) {
        const int two = nb - b0 >= 2;
        const int64_t c0 = 8 * b0;
        const __mmask16 k = two ? 0xffff : 0x00ff;
        __m256 dsc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, dmn[2] = {dsc[0], dsc[1]};
        for (int h = 0; h < 1 + two; h++) {
            const uint8_t *blk = row + (b0 + h) * bytes;
            prefetch_ahead(blk, (int)bytes);
            uint32_t wd[4];
            k4_words(blk + 4, wd);
            const __m128i sm8 = _mm_setr_epi32((int)wd[0], (int)wd[1], (int)wd[2], (int)wd[3]);
            dsc[h] = _mm256_mul_ps(_mm256_set1_ps(ld_half(blk)),
                                   _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm8)));
            dmn[h] = _mm256_mul_ps(_mm256_set1_ps(-ld_half(blk + 2)), _mm256_cvtepi32_ps(
                                       _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm8, sm8))));
        }
        const __m512 s16 = _mm512_insertf32x8(_mm512_castps256_ps512(dsc[0]), dsc[1], 1);
        const __m512 o16 = _mm512_insertf32x8(_mm512_castps256_ps512(dmn[0]), dmn[1], 1);
        for (int i = 0; i < mt; i++) {
            const int64_t r = (m0 + i) * nchunk + c0;
            _mm512_store_ps(sd[i], _mm512_mul_ps(s16, _mm512_maskz_loadu_ps(k, a->drow + r)));
            acc[i] = _mm512_mask3_fmadd_ps(o16, _mm512_maskz_loadu_ps(k, a->dsrow + r), acc[i], k);
        }
#define STEP(j)                                                                                 \
        if ((j) < 4 || two) {                                                                   \
            const uint8_t *blk = row + (b0 + (j) / 4) * bytes;                                  \
            const uint8_t *qs = blk + (five ? 48 : 16) + 32 * ((j) % 4);                        \
            __m512i w = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(              \
                _mm256_loadu_si256((const __m256i *)qs)), shifts), mask);                       \
            if (five) { /* bit 4: bit 2p (low half) and 2p + 1 (high half) of qh[l] */          \
                const __m512i hs = _mm512_setr_epi64(2 * ((j) % 4), 2 * ((j) % 4),              \
                    2 * ((j) % 4), 2 * ((j) % 4), 2 * ((j) % 4) + 1, 2 * ((j) % 4) + 1,         \
                    2 * ((j) % 4) + 1, 2 * ((j) % 4) + 1);                                      \
                const __m512i hb = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(   \
                    _mm256_loadu_si256((const __m256i *)(blk + 16))), hs), one);                \
                w = _mm512_or_si512(w, _mm512_slli_epi16(hb, 4));                               \
            }                                                                                   \
            const __m512i idx = SEQ_IDX(j);                                                     \
            for (int i = 0; i < mt; i++) {                                                      \
                const __m512i xv = _mm512_loadu_si512(a->q + (m0 + i) * K +                     \
                                                      (c0 + 2 * (j)) * CHUNK);                  \
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);           \
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),                                 \
                                         _mm512_permutexvar_ps(idx, _mm512_load_ps(sd[i])),     \
                                         acc[i]);                                               \
            }                                                                                   \
        }
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#undef STEP
    }
    for (int i = 0; i < mt; i++)
        res[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif

/* Each row kernel specialized for every tile height 1..MTI, behind one signature. */
typedef void (*rows_i8_fn)(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K,
                           int mt, float *res);
#define ROWS_I8(name, call)                                                                     \
    static void name(const uint8_t *row, int64_t nb, const qacts *a, int64_t m0, int64_t K,      \
                     int mt, float *res)                                                        \
    {                                                                                           \
        FOR_EACH_MTI(mt, call);                                                                 \
    }
#define Q5_0(k) q5_row_i8(row, nb, a, m0, K, 0, k, res)
#define Q5_1(k) q5_row_i8(row, nb, a, m0, K, 1, k, res)
#define Q2_K(k) q2k_row_i8(row, nb, a, m0, K, k, res)
#define Q3_K(k) q3k_row_i8(row, nb, a, m0, K, k, res)
#ifdef HAVE_ZMM_PATH
#define Q4_K(k) k4_row_z(row, nb, a, m0, K, 0, k, res)
#define Q5_K(k) k4_row_z(row, nb, a, m0, K, 1, k, res)
#else
#define Q4_K(k) k4_row_i8(row, nb, a, m0, K, 0, k, res)
#define Q5_K(k) k4_row_i8(row, nb, a, m0, K, 1, k, res)
#endif
#define Q6_K(k) q6k_row_i8(row, nb, a, m0, K, k, res)
#define IQ4_NL(k) iq4_row_i8(row, nb, a, m0, K, 0, k, res)
#define IQ4_XS(k) iq4_row_i8(row, nb, a, m0, K, 1, k, res)
#define MXFP4(k) mxfp4_row_i8(row, nb, a, m0, K, k, res)
ROWS_I8(q5_0_rows_i8, Q5_0)
ROWS_I8(q5_1_rows_i8, Q5_1)
ROWS_I8(q2_k_rows_i8, Q2_K)
ROWS_I8(q3_k_rows_i8, Q3_K)
ROWS_I8(q4_k_rows_i8, Q4_K)
ROWS_I8(q5_k_rows_i8, Q5_K)
ROWS_I8(q6_k_rows_i8, Q6_K)
ROWS_I8(iq4_nl_rows_i8, IQ4_NL)
ROWS_I8(iq4_xs_rows_i8, IQ4_XS)
ROWS_I8(mxfp4_rows_i8, MXFP4)
#undef Q5_0
#undef Q5_1
#undef Q2_K
#undef Q3_K
#undef Q4_K
#undef Q5_K
#undef Q6_K
#undef IQ4_NL
#undef IQ4_XS
#undef MXFP4
#undef ROWS_I8
#define I8(fn) , fn
#else
#define I8(fn)
#endif /* HAVE_I8_PATH */

/* ---- the GGML type table: one row per type ------------------------------------------------ */
typedef struct {
    int64_t kind;
    int block, block_bytes;
    int sums16; /* needs the activations' per-16 sums (q2_k's 16-input mins) */
    void (*dequant)(const uint8_t *blk, float *y); /* one block -> block floats */
    /* one block -> its codes and per-16 scales / offsets (the int8 GEMM; block codes above) */
    void (*codes)(const uint8_t *blk, uint8_t *u, float *s, float *o);
    int z;      /* the codes' zero point */
    int halves; /* 2: a scale per 16 inputs; 1: per 32 (equal halves) */
    int asym;   /* whether o is ever nonzero */
    int umax;   /* the largest code */
#ifdef HAVE_I8_PATH
    rows_i8_fn rows_i8; /* one weight row against up to MTI int8 activation rows */
#endif
} ggml_type;

static const ggml_type GGML_TYPES[] = {
    {KIND_Q5_0, 32, 22, 0, deq_q5_0, codes_q5_0, 16, 1, 0, 31 I8(q5_0_rows_i8)},
    {KIND_Q5_1, 32, 24, 0, deq_q5_1, codes_q5_1, 0, 1, 1, 31 I8(q5_1_rows_i8)},
    {KIND_Q2_K, QK_K, 84, 1, deq_q2_k, codes_q2_k, 0, 2, 1, 3 I8(q2_k_rows_i8)},
    {KIND_Q3_K, QK_K, 110, 0, deq_q3_k, codes_q3_k, 4, 2, 0, 7 I8(q3_k_rows_i8)},
    {KIND_Q4_K, QK_K, 144, 0, deq_q4_k, codes_q4_k, 0, 1, 1, 15 I8(q4_k_rows_i8)},
    {KIND_Q5_K, QK_K, 176, 0, deq_q5_k, codes_q5_k, 0, 1, 1, 31 I8(q5_k_rows_i8)},
    {KIND_Q6_K, QK_K, 210, 0, deq_q6_k, codes_q6_k, 32, 2, 0, 63 I8(q6_k_rows_i8)},
    {KIND_IQ4_NL, 32, 18, 0, deq_iq4_nl, codes_iq4_nl, 128, 1, 0, 241 I8(iq4_nl_rows_i8)},
    {KIND_IQ4_XS, QK_K, 136, 0, deq_iq4_xs, codes_iq4_xs, 128, 1, 0, 241 I8(iq4_xs_rows_i8)},
    {KIND_MXFP4, 32, 17, 0, deq_mxfp4, codes_mxfp4, 12, 1, 0, 24 I8(mxfp4_rows_i8)},
};
#undef I8

static const ggml_type *ggml_type_of(int64_t kind)
{
    for (size_t i = 0; i < sizeof GGML_TYPES / sizeof GGML_TYPES[0]; i++)
        if (GGML_TYPES[i].kind == kind)
            return &GGML_TYPES[i];
    return NULL;
}

/* ---- fp32 activations: decode each block once, dot it with every activation row ---------- */
static inline __attribute__((always_inline)) void
ggml_row_f32(const ggml_type *t, const uint8_t *row, int64_t nb, const float *x, int64_t ldx,
             const int mt, float *res)
{
    float w[QK_K] __attribute__((aligned(32)));
#ifdef HAVE_I8_PATH
    __m256 a0[MT], a1[MT];
    for (int i = 0; i < mt; i++)
        a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_ahead(row + b * t->block_bytes, t->block_bytes);
        t->dequant(row + b * t->block_bytes, w);
        const float *xb = x + b * t->block;
        for (int k = 0; k < t->block; k += 16) {
            const __m256 w0 = _mm256_load_ps(w + k), w1 = _mm256_load_ps(w + k + 8);
            for (int i = 0; i < mt; i++) {
                a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + i * ldx + k), a0[i]);
                a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + i * ldx + k + 8), a1[i]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        res[i] = hsum(_mm256_add_ps(a0[i], a1[i]));
#else
    float acc[MT][16] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        t->dequant(row + b * t->block_bytes, w);
        const float *xb = x + b * t->block;
        for (int i = 0; i < mt; i++)
            for (int k = 0; k < t->block; k++)
                acc[i][k % 16] += w[k] * xb[i * ldx + k];
    }
    for (int i = 0; i < mt; i++) {
        float s = 0.f;
        for (int j = 0; j < 16; j++)
            s += acc[i][j];
        res[i] = s;
    }
#endif
}

static void ggml_rows_f32(const ggml_type *t, const uint8_t *row, int64_t nb, const float *x,
                          int64_t ldx, int mt, float *res)
{
#define CALL(k) ggml_row_f32(t, row, nb, x, ldx, k, res)
    FOR_EACH_MT(mt, CALL);
#undef CALL
}

/* y = x W^T (+ bias) for W of GGML type t: x (M, K) fp32, row stride ldx; y row stride ldy. */
static void ggml_matmul(const ggml_type *t, const wdesc *W, const float *x, int64_t M, int64_t ldx,
                        float *y, int64_t ldy, int i8, int nthreads)
{
    const int64_t nb = W->K / t->block;
#ifdef HAVE_I8_PATH
    qacts a = {0};
    if (i8)
        a = quantize_activations(x, M, W->K, ldx, W->K, 0, t->sums16, nthreads);
#else
    i8 = 0;
#endif
    const int64_t item = run_item(W->N, W->row_bytes, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, item)
    for (int64_t n = 0; n < W->N; n++) {
        const uint8_t *row = (const uint8_t *)W->w + n * W->row_bytes;
        const int64_t tile = i8 ? MTI : MT;
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            float res[MTI];
            const int mt = M - m0 < tile ? (int)(M - m0) : (int)tile;
#ifdef HAVE_I8_PATH
            if (i8)
                t->rows_i8(row, nb, &a, m0, W->K, mt, res);
            else
#endif
                ggml_rows_f32(t, row, nb, x + m0 * ldx, ldx, mt, res);
            for (int i = 0; i < mt; i++)
                y[(m0 + i) * ldy + n] = res[i] + (W->bias ? W->bias[n] : 0.f);
        }
    }
#ifdef HAVE_I8_PATH
    if (i8)
        free_activations(a);
#endif
}

static void ggml_dequant_row(const ggml_type *t, const wdesc *W, int64_t n, float *out)
{
    const uint8_t *row = (const uint8_t *)W->w + n * W->row_bytes;
    for (int64_t b = 0; b < W->K / t->block; b++)
        t->dequant(row + b * t->block_bytes, out + b * t->block);
}

/* ---- dense fp16 / bf16 -------------------------------------------------------------------- */

#ifdef HAVE_ATT_SIMD
/* 8 fp16 or bf16 values at p, widened to fp32 exactly (bf16 by a 16-bit shift, fp16 by F16C) */
static inline __attribute__((always_inline)) __m256 half8_ps(const uint16_t *p, const int bf16)
{
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                : _mm256_cvtph_ps(h);
}
#endif

/* t + the products of one row's inputs k0 .. K (the row kernel's tail, past its last 16; the
 * tile GEMM's too, so both end alike) */
static inline __attribute__((always_inline)) float
half_tail(const uint16_t *w, int64_t k0, int64_t K, const float *x, const int bf16, float t)
{
    for (int64_t k = k0; k < K; k++) {
        const uint16_t h = w[k];
        half f;
        memcpy(&f, &h, 2);
        t += (bf16 ? bf16_to_f32(h) : (float)f) * x[k];
    }
    return t;
}

/* nr (<= NR) consecutive fp16 or bf16 weight rows against one fp32 activation row, as f32_rows
 * (each weight widened by half8_ps as it is multiplied). */
static inline __attribute__((always_inline)) void
half_rows(const uint16_t *w, int64_t K, const float *x, const int bf16, const int nr, float *res)
{
    int64_t k0 = 0;
    float t[NR];
#ifdef HAVE_ATT_SIMD
    __m256 a0[NR], a1[NR];
    for (int r = 0; r < nr; r++)
        a0[r] = a1[r] = _mm256_setzero_ps();
    for (; k0 + 16 <= K; k0 += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + k0), x1 = _mm256_loadu_ps(x + k0 + 8);
        for (int r = 0; r < nr; r++) {
            if ((k0 & 31) == 0)
                prefetch_ahead((const uint8_t *)(w + r * K + k0), 1);
            a0[r] = _mm256_fmadd_ps(half8_ps(w + r * K + k0, bf16), x0, a0[r]);
            a1[r] = _mm256_fmadd_ps(half8_ps(w + r * K + k0 + 8, bf16), x1, a1[r]);
        }
    }
    for (int r = 0; r < nr; r++)
        t[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
#else
    for (int r = 0; r < nr; r++)
        t[r] = 0.f;
#endif
    for (int r = 0; r < nr; r++)
        res[r] = half_tail(w + r * K, k0, K, x, bf16, t[r]);
}

static void half_tile(const uint16_t *w, int64_t K, const float *x, int bf16, int nr, float *res)
{
#define CALL(k) (bf16 ? half_rows(w, K, x, 1, k, res) : half_rows(w, K, x, 0, k, res))
    switch (nr) {
    case 1: CALL(1); break;
    case 2: CALL(2); break;
    case 3: CALL(3); break;
    default: CALL(NR);
    }
#undef CALL
}

/* ---- dense fp16 / bf16 at a few rows: a tile GEMM with the row kernel's arithmetic ----------
 * The row kernel (half_rows) converts each weight as it multiplies, once per activation row:
 * at 32 rows (a decode batch, a speculative step's verification) ~40 GMAC/s, bound by the
 * conversions. Here a thread converts HG_NB weight rows a chunk of HG_KC inputs at a time into
 * fp32 in L1 (half_tile_chunk) and multiplies that against every activation row (half_pass),
 * so a weight is converted once a call. Each (row, weight row) pair keeps the row kernel's two
 * sums, a0 over inputs 16j .. 16j + 7 and a1 over 16j + 8 .. 16j + 15, as 16 floats (one zmm
 * in the AVX-512 build, two ymm passes in the AVX2 one), each lane the same fmadd of the same
 * operands in the same order, then the same hsum(a0 + a1) and tail (half_tail): a row's result
 * is the row kernel's bit for bit, whatever the batch, so the crossover (half_gemm_rows) is a
 * matter of speed only. */
#ifndef HG_NB
#define HG_NB 16 /* weight rows a tile (a multiple of 4: half_pass takes 4) */
#endif
#ifndef HG_KC
#define HG_KC 256 /* inputs a chunk: the tile's fp32 chunk is 16 KiB */
#endif
#ifdef HAVE_ZMM_PATH
#define HG_MR 6 /* activation rows a pass: 24 zmm sums, 6 rows' inputs and a weight vector */
#else
#define HG_MR 3 /* 12 ymm sums, 3 rows' inputs and a weight vector */
#endif
/* The crossover, fp16 1B shapes (2048 x 2048, 8192 x 2048, 2048 x 8192), 2 threads, a
 * Sapphire Rapids VM, GMAC/s of the row kernel against the tile GEMM at 1 / 2 / 3 / 4 / 8 / 32
 * rows: AVX-512 19-24 / 34-36 / 36-39 / 42-43 / 45-48 / 42-48 against 18-21 / 33-36 / 45-50 /
 * 53-57 / 70-74 / 82-98; AVX2 (QSERVE_CPU_ISA=avx2) 21-26 / 33-36 / 37-40 / 39-43 / 45-46 /
 * 41-50 against 17-19 / 26-32 / 35-42 / 41-46 / 57-59 / 65-76 */
#ifndef HALF_GEMM_ROWS
#ifdef HAVE_ZMM_PATH
#define HALF_GEMM_ROWS 3
#else
#define HALF_GEMM_ROWS 4
#endif
#endif
static int half_gemm_rows = HALF_GEMM_ROWS;

/* From how many rows half_matmul takes the tile GEMM: rows >= 1; 0, never; < 0, the built-in
 * crossover (tests and benchmarks compare the two, which agree bit for bit) */
void set_half_gemm_rows(int rows)
{
    half_gemm_rows = rows < 0 ? HALF_GEMM_ROWS : rows;
}

#ifdef HAVE_ATT_SIMD
/* MR activation rows (x: inputs 0 .. kn of each, stride ldx) against 4 converted weight rows
 * (wt, stride HG_KC), adding into their sums (s: pair (i, r) at s + i * lds + 16 r), which
 * the first chunk (first) starts at zero as the row kernel's do */
static inline __attribute__((always_inline)) void
half_pass(const float *wt, const float *x, int64_t ldx, int64_t kn, float *s, int64_t lds,
          const int first, const int MR)
{
#ifdef HAVE_ZMM_PATH
    __m512 a[HG_MR][4];
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < 4; r++)
            a[i][r] = first ? _mm512_setzero_ps() : _mm512_load_ps(s + i * lds + 16 * r);
    for (int64_t k = 0; k < kn; k += 16) {
        __m512 xv[HG_MR];
        for (int i = 0; i < MR; i++)
            xv[i] = _mm512_loadu_ps(x + i * ldx + k);
        for (int r = 0; r < 4; r++) {
            const __m512 wv = _mm512_load_ps(wt + r * HG_KC + k);
            for (int i = 0; i < MR; i++)
                a[i][r] = _mm512_fmadd_ps(wv, xv[i], a[i][r]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int r = 0; r < 4; r++)
            _mm512_store_ps(s + i * lds + 16 * r, a[i][r]);
#else
    for (int h = 0; h < 16; h += 8) { /* a0's lanes, then a1's */
        __m256 a[HG_MR][4];
        for (int i = 0; i < MR; i++)
            for (int r = 0; r < 4; r++)
                a[i][r] = first ? _mm256_setzero_ps()
                                : _mm256_load_ps(s + i * lds + 16 * r + h);
        for (int64_t k = h; k < kn; k += 16) {
            __m256 xv[HG_MR];
            for (int i = 0; i < MR; i++)
                xv[i] = _mm256_loadu_ps(x + i * ldx + k);
            for (int r = 0; r < 4; r++) {
                const __m256 wv = _mm256_load_ps(wt + r * HG_KC + k);
                for (int i = 0; i < MR; i++)
                    a[i][r] = _mm256_fmadd_ps(wv, xv[i], a[i][r]);
            }
        }
        for (int i = 0; i < MR; i++)
            for (int r = 0; r < 4; r++)
                _mm256_store_ps(s + i * lds + 16 * r + h, a[i][r]);
    }
#endif
}

/* Weight rows n0 .. n0 + nr, inputs k0 .. k0 + kn (multiples of 16), to fp32 in wt (HG_NB rows
 * of HG_KC; rows past nr zero), widened as the row kernel widens them (half8_ps) */
static void half_tile_chunk(const uint16_t *w, int64_t K, int64_t n0, int64_t nr, int64_t k0,
                            int64_t kn, const int bf16, float *wt)
{
    for (int64_t r = 0; r < HG_NB; r++) {
        float *o = wt + r * HG_KC;
        if (r >= nr) {
            memset(o, 0, sizeof(float) * (size_t)kn);
            continue;
        }
        const uint16_t *src = w + (n0 + r) * K + k0;
        for (int64_t k = 0; k < kn; k += 8)
            _mm256_store_ps(o + k, half8_ps(src + k, bf16));
    }
}

static void half_gemm(const wdesc *W, const float *x, int64_t M, int64_t ldx, float *y,
                      int64_t ldy, int nthreads)
{
    const uint16_t *w = (const uint16_t *)W->w;
    const int64_t N = W->N, K = W->K, K16 = K / 16 * 16, lds = 16 * HG_NB;
    const int bf16 = W->kind == KIND_BF16;
#pragma omp parallel num_threads(nthreads)
    {
        float *wt = aligned_alloc(64, sizeof(float) * HG_NB * HG_KC);
        float *s = aligned_alloc(64, sizeof(float) * (size_t)(lds * M));
#pragma omp for schedule(dynamic, 1)
        for (int64_t n0 = 0; n0 < N; n0 += HG_NB) {
            const int64_t nr = N - n0 < HG_NB ? N - n0 : HG_NB;
            for (int64_t k0 = 0; k0 < K16; k0 += HG_KC) {
                const int64_t kn = K16 - k0 < HG_KC ? K16 - k0 : HG_KC;
                const int f = k0 == 0; /* the first chunk: the sums start at zero */
                half_tile_chunk(w, K, n0, nr, k0, kn, bf16, wt);
                for (int64_t m0 = 0; m0 < M; m0 += HG_MR) {
                    const float *xm = x + m0 * ldx + k0;
                    for (int64_t r0 = 0; r0 < nr; r0 += 4) {
                        const float *wr = wt + r0 * HG_KC;
                        float *sr = s + m0 * lds + 16 * r0;
                        switch (M - m0 < HG_MR ? (int)(M - m0) : HG_MR) {
                        case 1: half_pass(wr, xm, ldx, kn, sr, lds, f, 1); break;
                        case 2: half_pass(wr, xm, ldx, kn, sr, lds, f, 2); break;
#ifdef HAVE_ZMM_PATH
                        case 3: half_pass(wr, xm, ldx, kn, sr, lds, f, 3); break;
                        case 4: half_pass(wr, xm, ldx, kn, sr, lds, f, 4); break;
                        case 5: half_pass(wr, xm, ldx, kn, sr, lds, f, 5); break;
#endif
                        default: half_pass(wr, xm, ldx, kn, sr, lds, f, HG_MR);
                        }
                    }
                }
            }
            for (int64_t m = 0; m < M; m++)
                for (int64_t r = 0; r < nr; r++) {
                    const float *a = s + m * lds + 16 * r; /* K < 16: no chunk, sums 0 */
                    float t = K16 ? hsum(_mm256_add_ps(_mm256_load_ps(a), _mm256_load_ps(a + 8)))
                                  : 0.f;
                    t = half_tail(w + (n0 + r) * K, K16, K, x + m * ldx, bf16, t);
                    y[m * ldy + n0 + r] = t + (W->bias ? W->bias[n0 + r] : 0.f);
                }
        }
        free(s);
        free(wt);
    }
}
#endif

/* y = x W^T (+ bias) for a dense fp16/bf16 W (N, K): f32_matmul with conversion on load, or
 * from half_gemm_rows rows the tile GEMM (the same bits). */
static void half_matmul(const wdesc *W, const float *x, int64_t M, int64_t ldx, float *y,
                        int64_t ldy, int nthreads)
{
    const uint16_t *w = (const uint16_t *)W->w;
    const int64_t N = W->N, K = W->K;
    const int bf16 = W->kind == KIND_BF16;
#ifdef HAVE_ATT_SIMD
    if (half_gemm_rows > 0 && M >= half_gemm_rows) {
        half_gemm(W, x, M, ldx, y, ldy, nthreads);
        return;
    }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, ROW_ITEM)
    for (int64_t nb = 0; nb < (N + NR - 1) / NR; nb++) {
        const int64_t n = nb * NR;
        const int nr = N - n < NR ? (int)(N - n) : NR;
        for (int64_t m = 0; m < M; m++) {
            float res[NR];
            half_tile(w + n * K, K, x + m * ldx, bf16, nr, res);
            for (int r = 0; r < nr; r++)
                y[m * ldy + n + r] = res[r] + (W->bias ? W->bias[n + r] : 0.f);
        }
    }
}

static void half_dequant_row(const wdesc *W, int64_t n, float *out)
{
    const int64_t K = W->K;
    if (W->kind == KIND_BF16) { /* one loop per kind, each vectorizable */
        const uint16_t *w = (const uint16_t *)W->w + n * K;
        for (int64_t k = 0; k < K; k++)
            out[k] = bf16_to_f32(w[k]);
        return;
    }
    const half *w = (const half *)W->w + n * K;
    int64_t k = 0;
#ifdef HAVE_ATT_SIMD /* gcc does not vectorize the _Float16 conversion */
    for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + k))));
#endif
    for (; k < K; k++)
        out[k] = (float)w[k];
}

/* ---- q4_k_x16: Q4_K with 16 rows interleaved (AVX-512 VNNI and AVX2 builds) ----------------
 * qserve/formats/ggml.py interleave_q4_k lays out a q4_k matrix whose row count is a multiple of
 * 16 by groups of 16 rows. Group g (rows 16g .. 16g + 15) is its K / 256 super-blocks in order,
 * X16_SB bytes each:
 *
 *   +0    d[16]             fp16, row r's d
 *   +32   dmin[16]          fp16
 *   +64   lo[8][16]         sub-block j's 6-bit scale sc and min m of row r, their low 4 bits:
 *                           sc & 15 | (m & 15) << 4
 *   +192  hi[4][16]         their top 2 bits, sub-blocks 2i and 2i + 1: bits 0-1 sc_2i >> 4,
 *                           2-3 m_2i >> 4, 4-5 sc_2i+1 >> 4, 6-7 m_2i+1 >> 4 (x16_scales)
 *   +256  qs[4][8][16][4]   [p][lg][r][t] = byte 4 lg + t of row r's qs run p (qs[32 p + 4 lg + t]
 *                           of the block): low nibble input 64 p + 4 lg + t (sub-block 2p),
 *                           high nibble input 64 p + 32 + 4 lg + t (sub-block 2p + 1)
 *
 * The file's bytes, moved, 144 a row and block as in the file; only the 12-byte scale packing is
 * rearranged so that one 16-byte load and a few shifts give a sub-block's 16 scales (and mins).
 * They were stored unpacked, a byte each (148 bytes a row and block), until 2026-12-05: 2.8%
 * more bytes to stream and hold. w = d sc_j q - dmin m_j as for q4_k. One 64-byte load is 4
 * inputs of 16 rows, so
 * a vpdpbusd against 4 activation bytes broadcast adds their products into 16 row lanes, and 8
 * make a sub-block's exact integer dot for 16 rows, converted and scaled once: ~3.5 vector ops a
 * vpdpbusd, against ~6 in k4_row_z (which converts and scales after every one). The int8 GEMM
 * takes its tiles straight from these bytes (x16_pack_tile), without the codes or transposes.
 * AVX2 builds run q4_k_x16 too (x16_rows_y: each 64-byte vector is two ymm, rows 0-7 and 8-15;
 * their GEMM's 8-row tiles are one ymm of each). */
#ifdef HAVE_I8_PATH
#define X16 16
#define X16_SB (X16 * 144)
#define X16_LO 64
#define X16_HI 192
#define X16_QS 256
/* How far ahead the _x16 row kernels prefetch their weight stream. Once it was one line, which
 * left the stream to the hardware prefetchers: on a Zen 4 (2 threads, 14 q4_k_x16 matrices of
 * 16384 x 2048 cycled, so read from DRAM) they read at 0.84x of a torch sum's bandwidth that
 * way against 0.42-0.54x prefetching 1-16 KiB ahead in a burst at each step. */
/* Those prefetches go out in a burst, a super-block's (or chunk's) lines at its start: ahead
 * of the data they stall the kernel (the line-fill buffers fill). Spread out instead, a share
 * of the lines some way ahead at each step of a super-block (prefetch_part), they help where
 * a kernel's own order leaves the hardware prefetchers behind: Q6_K's three regions of a
 * super-block (low bits, high bits, scales) read side by side, and AVX2's int4. Zen 4, 2
 * threads, 600 MB of 1B-shaped matrices cycled from DRAM, one process alternating builds, at
 * batch 1: AVX2 q6_k_x16 (2048 x 8192, a down projection) 20.8 / 14.0 GB/s -> 26.9-28.1 / 19.9
 * two super-blocks ahead (24.0 one ahead, 27.5 four), and 8192 x 2048 at 2 / 4 rows 12.3 /
 * 14.6 -> 16.4 / 15.7; AVX2 int4_x16 (8192 x 2048) 24.1-24.7 -> 25.4-27.6 4 KiB ahead; 512-bit
 * q6_k_x16 (8192 x 2048) 26.6 -> 29.7. 512-bit int4 read no faster (27.1 -> 27.3) and keeps
 * the burst. Q4_K's kernels read no faster on that Zen 4 spread out (AVX2 21.4-28.8 -> 21.7-27.0,
 * 148-byte rows) but do on a 2-core Sapphire Rapids VM, one super-block ahead (packed 144-byte
 * rows, 8192 x 2048 from DRAM, 2 threads, separate processes alternated): AVX2 15.4 -> 18.5 GB/s
 * (17.9 two ahead, 17.2 in a burst one ahead) and 38.8 -> 50.3 from cache, where the
 * burst had stalled it; 512-bit 18.6 -> 19.0; 1B Q4_K_M batch-1 decode 24.4 -> 25.6 tok/s
 * (AVX2) and 26.0 -> 27.7 (512-bit) with the packed scales, against 24.5 / 25.9 before both. */
#ifndef X16Q6_AHEAD
#define X16Q6_AHEAD (2 * X16Q6_SB)
#endif
#ifndef X16Q4_AHEAD
#define X16Q4_AHEAD X16_SB
#endif
#define X16I4_AHEAD 4096
/* A line at a time, at each 64-byte load, is the finest spread: the 512-bit q4_k_x16 kernel
 * does that at one to three rows (its two runs), the 512-bit int4_x16 one at any. On a Zen 4
 * (2026-12-06, 400 MB of 1B-shaped matrices cycled from DRAM, one process alternating builds),
 * q4_k_x16 16384 x 2048 at 1 row read 16.3 -> 24.4 GB/s on one thread and 25.0 -> 29.8 on
 * two, 22.6 -> 31.6 at 2 rows, the same at 4 and 8 (their one run keeps a burst a step);
 * int4_x16, 4 KiB ahead, 15.9 -> 17.6 (one thread) and 25.7 -> 27.3 (two) at 1 row, 19.8 ->
 * 24.7 at 3, 11.2 -> 15.1 at 8. q6_k_x16 read slower that way (22.6 -> 16.7-18.7 GB/s on one
 * thread), and AVX2's q4_k_x16 too (19.2 -> 16.6): they keep their bursts of a few lines. */

/* Prefetch share `part` of `parts` of the `bytes` bytes at p, a line at a time */
static inline __attribute__((always_inline)) void prefetch_part(const uint8_t *p, int part,
                                                                int parts, int bytes)
{
    const int per = (bytes / 64 + parts - 1) / parts * 64;
    for (int o = part * per; o < (part + 1) * per && o < bytes; o += 64)
        _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
}

/* A q4_k_x16 super-block's 6-bit scales and mins, a byte each: sc[16 j + r], mn[16 j + r] for
 * sub-block j and row r. Two sub-blocks a ymm. Every kernel unpacks a super-block's once, before
 * it needs them: 1B Q4_K_M batch-1 decode (AVX2, a 2-core Sapphire Rapids) read 23.0 tok/s
 * unpacking a sub-block's per row half and step, 23.6 once a super-block, against 24.5 with the
 * scales stored a byte each; the spread prefetch (prefetch_part) more than made up the rest. */
static inline __attribute__((always_inline)) void x16_scales(const uint8_t *sb, uint8_t *sc,
                                                             uint8_t *mn)
{
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    for (int i = 0; i < 4; i++) { /* sub-blocks 2i (low lane) and 2i + 1 (high lane) */
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(sb + X16_LO + 32 * i));
        const __m128i h = _mm_loadu_si128((const __m128i *)(sb + X16_HI + 16 * i));
        const __m256i hi = _mm256_set_m128i(_mm_srli_epi16(h, 4), h); /* 2i + 1's bits down */
        _mm256_storeu_si256((__m256i *)(sc + 32 * i),
                            _mm256_or_si256(_mm256_and_si256(lo, m4),
                                            _mm256_slli_epi16(_mm256_and_si256(hi, m3), 4)));
        _mm256_storeu_si256(
            (__m256i *)(mn + 32 * i),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2), m3), 4)));
    }
}

/* Row r of a group's super-block sb -> its codes, scales and offsets, as codes_k4 gives them
 * for the block it came from (the same products, so the same floats). */
static void codes_x16(const uint8_t *sb, int r, uint8_t *u, float *s, float *o)
{
    const float d = ld_half(sb + 2 * r), dmin = ld_half(sb + 32 + 2 * r);
    const __m256i stride = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int p = 0; p < 4; p++) {
        const __m256i q = _mm256_i32gather_epi32((const int *)(sb + X16_QS + 512 * p + 4 * r),
                                                 stride, 1);
        _mm256_storeu_si256((__m256i *)(u + 64 * p), _mm256_and_si256(q, m4));
        _mm256_storeu_si256((__m256i *)(u + 64 * p + 32),
                            _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
    }
    uint8_t sc[128], mn[128];
    x16_scales(sb, sc, mn);
    for (int j = 0; j < 8; j++) {
        s[2 * j] = s[2 * j + 1] = d * (float)sc[16 * j + r];
        o[2 * j] = o[2 * j + 1] = -(dmin * (float)mn[16 * j + r]);
    }
}

static void x16_dequant_row(const wdesc *W, int64_t n, float *out)
{
    const uint8_t *grp = (const uint8_t *)W->w + n / X16 * X16 * W->row_bytes;
    uint8_t u[QK_K] __attribute__((aligned(32)));
    float s[QK_K / 16], o[QK_K / 16];
    for (int64_t b = 0; b < W->K / QK_K; b++) {
        codes_x16(grp + b * X16_SB, (int)(n % X16), u, s, o);
        for (int j = 0; j < 8; j++)
            deq32(_mm256_load_si256((const __m256i *)(u + 32 * j)), 0, s[2 * j], o[2 * j],
                  out + b * QK_K + 32 * j);
    }
}

/* Row n of an int4_x16 W, chunks k0 / 32 .. k1 / 32, as codes in gemm_codes_row's form:
 * u the 32 codes in input order, one scale and offset per 16 inputs (0 offsets where
 * symmetric: the GEMM's traits take the zero point 8) */
static void x16i4_codes_row(const wdesc *W, int64_t n, int64_t k0, int64_t k1, uint8_t *u,
                            float *s, float *o)
{
    const int64_t Kp = W->Kp, G = Kp / W->group_size, cpg = W->group_size / CHUNK;
    const int64_t g = n / X16, r = n % X16;
    const uint8_t *grp = (const uint8_t *)W->w + g * X16 * (Kp / 2);
    const half *sc = W->scales + g * X16 * G, *of = W->offsets ? W->offsets + g * X16 * G : NULL;
    const __m128i idx = _mm_setr_epi32(0, 64, 128, 192), m4 = _mm_set1_epi8(15);
    for (int64_t c = k0 / CHUNK; c < k1 / CHUNK; c++) {
        const int64_t j = c - k0 / CHUNK, gi = c / cpg;
        const __m128i v = _mm_i32gather_epi32((const int *)(grp + c * 256 + 4 * r), idx, 1);
        _mm_storeu_si128((__m128i *)(u + 32 * j), _mm_and_si128(v, m4));
        _mm_storeu_si128((__m128i *)(u + 32 * j + 16), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
        s[2 * j] = s[2 * j + 1] = (float)sc[X16 * gi + r];
        o[2 * j] = o[2 * j + 1] = of ? (float)of[X16 * gi + r] : 0.f;
    }
}

/* Row n of an int4_x16 W, its first K inputs: q s + o, as q4_dequant_row (q s is exact in
 * fp32, so one rounding either way) */
static void x16i4_dequant_row(const wdesc *W, int64_t n, float *out)
{
    for (int64_t c = 0; c * CHUNK < W->K; c++) {
        uint8_t u[CHUNK];
        float s[2], o[2];
        x16i4_codes_row(W, n, c * CHUNK, (c + 1) * CHUNK, u, s, o);
        const float ov = W->offsets ? o[0] : -8.f * s[0];
        for (int64_t k = c * CHUNK; k < W->K && k < (c + 1) * CHUNK; k++)
            out[k] = (float)u[k - c * CHUNK] * s[0] + ov;
    }
}

/* ---- q6_k_x16: Q6_K with 16 rows interleaved, alike -----------------------------------------
 * Group g's super-blocks, X16Q6_SB bytes each (212 a row: 210 + 2 bytes of padding that keep
 * every super-block 64-byte aligned):
 *
 *   +0     ql[2][2][8][16][4]  [h][e][lg][r][t] = ql[64 h + 32 e + 4 lg + t] of row r's block:
 *                              low nibble input 128 h + 32 e + 4 lg + t, high nibble the
 *                              input 64 after it (the low 4 bits of the code)
 *   +2048  qh[2][8][16][4]     [h][lg][r][t] = qh[32 h + 4 lg + t]: bits 2f, 2f + 1 the top 2
 *                              bits of input 128 h + 32 f + 4 lg + t
 *   +3072  sc[16][16]          int8: 16-input sub-block s's scale, row r
 *   +3328  d[16]               fp16
 *   +3360  32 zero bytes
 *
 * w = d sc_s (q - 32). One load of each kind gives 4 vectors of 6-bit codes (f = 0..3) for 4
 * inputs of 16 rows, each a vpdpbusd against 4 activation bytes (AVX2: two ymm of 8 rows, each
 * a vpmaddubsw); a sub-block's integer sum is scaled once, and -32 d sc_s times the
 * activations' sum of the sub-block added alongside. */
#define X16Q6_SB (X16 * 212)
#define X16Q6_MT 4 /* activation rows a tile: more would spill the accumulators */
#ifndef X16Q6_BOTH
#define X16Q6_BOTH X16Q6_MT /* AVX2: up to this many activation rows take both row halves in
                              * turn (all of a tile's; a smaller value is the two-pass order) */
#endif
#define X16Q6_QH 2048
#define X16Q6_SC 3072
#define X16Q6_D 3328

/* Row r of a group's super-block -> its codes and scales as codes_q6_k gives them */
static void codes_x16q6(const uint8_t *sb, int r, uint8_t *u, float *s, float *o)
{
    const float d = ld_half(sb + X16Q6_D + 2 * r);
    const __m256i stride = _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448);
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i qh = _mm256_i32gather_epi32(
            (const int *)(sb + X16Q6_QH + 512 * h + 4 * r), stride, 1);
        for (int e = 0; e < 2; e++) {
            const __m256i ql = _mm256_i32gather_epi32(
                (const int *)(sb + 512 * (2 * h + e) + 4 * r), stride, 1);
            /* f = e (low nibbles) and f = e + 2 (high) */
            const __m256i hl = e ? _mm256_slli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4);
            const __m256i hh = e ? _mm256_srli_epi16(qh, 2) : qh;
            _mm256_storeu_si256((__m256i *)(u + 128 * h + 32 * e),
                                _mm256_or_si256(_mm256_and_si256(ql, m4),
                                                _mm256_and_si256(hl, m30)));
            _mm256_storeu_si256((__m256i *)(u + 128 * h + 32 * (e + 2)),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), m4),
                                                _mm256_and_si256(hh, m30)));
        }
    }
    for (int j = 0; j < 16; j++) {
        s[j] = d * (float)(int8_t)sb[X16Q6_SC + 16 * j + r];
        o[j] = 0.f;
    }
}

static void x16q6_dequant_row(const wdesc *W, int64_t n, float *out)
{
    const uint8_t *grp = (const uint8_t *)W->w + n / X16 * X16 * W->row_bytes;
    uint8_t u[QK_K] __attribute__((aligned(32)));
    float s[QK_K / 16], o[QK_K / 16];
    for (int64_t b = 0; b < W->K / QK_K; b++) {
        codes_x16q6(grp + b * X16Q6_SB, (int)(n % X16), u, s, o);
        float *y = out + b * QK_K;
        for (int j = 0; j < QK_K / 16; j++) { /* as deq_q6_k */
            const __m128i c = _mm_load_si128((const __m128i *)(u + 16 * j));
            const __m256 vs = _mm256_set1_ps(s[j]), vo = _mm256_set1_ps(-32.f * s[j]);
            _mm256_storeu_ps(y + 16 * j, _mm256_fmadd_ps(u8_to_ps(c), vs, vo));
            _mm256_storeu_ps(y + 16 * j + 8,
                             _mm256_fmadd_ps(u8_to_ps(_mm_srli_si128(c, 8)), vs, vo));
        }
    }
}

#ifndef HAVE_ZMM_PATH
/* AVX2: one group's 16 rows against activation rows m0 .. m0 + mt (int8, ACT_PLAIN): res[16 i +
 * r]. Each 64-byte vector of the layout is two ymm, rows 0-7 (h = 0) and 8-15 (h = 1), taken in
 * turn; a vpmaddubsw adds a pair of products into each of a row's 4 int16 lanes, the 8 of a
 * sub-block sum exactly in int16 (8 * 2 * 15 * 127 < 2^15), one vpmaddwd against ones makes
 * them the sub-block's 8 row sums, converted and scaled once (as x16_rows_z). Activation rows
 * go 4 at a time: 8 int16 sums, 2 weight vectors and a broadcast stay in registers, and each
 * vector's nibble split serves 4 rows. On a Zen 4 (1B gate_up and o_proj from cache, 2
 * threads, one process alternating builds) 8-32 rows ran 4-12% faster than 2 at a time, 3
 * and 8 no faster than 2; q4_k_x16 and int4_x16 alike. A row's arithmetic does not depend on
 * mt (exact integer sums, its own accumulators in a fixed order). */
#define X16Y_MT 4
static inline __attribute__((always_inline)) void
x16_rows_y(const uint8_t *grp, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int mt,
           float *res)
{
    __m256 f[2][2][MTI]; /* [h][u][i]: two fma chains a row half */
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < mt; i++)
            f[h][0][i] = f[h][1][i] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = grp + b * X16_SB;
        uint8_t scs[128], mns[128];
        x16_scales(sb, scs, mns);
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * h)));
            const __m256 dmin = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(sb + 32 + 16 * h)));
            for (int p = 0; p < 4; p++) {
                prefetch_part(sb + X16Q4_AHEAD, 4 * h + p, 8, X16_SB);
                __m256 s[2], o[2];
                for (int u = 0; u < 2; u++) {
                    const int j = 2 * p + u;
                    s[u] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i *)(scs + 16 * j + 8 * h)))));
                    o[u] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                        _mm_loadl_epi64((const __m128i *)(mns + 16 * j + 8 * h)))));
                }
                for (int i0 = 0; i0 < mt; i0 += X16Y_MT) {
                    const int n = mt - i0 < X16Y_MT ? mt - i0 : X16Y_MT;
                    __m256i acc[2][X16Y_MT]; /* [u][i - i0] int16 */
                    for (int lg = 0; lg < 8; lg++) {
                        const __m256i q = _mm256_loadu_si256(
                            (const __m256i *)(sb + X16_QS + 512 * p + 64 * lg + 32 * h));
                        const __m256i wl = _mm256_and_si256(q, m4);
                        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                        for (int ii = 0; ii < n; ii++) {
                            const int8_t *xq = a->q + (m0 + i0 + ii) * K + b * QK_K + 64 * p + 4 * lg;
                            int32_t x0, x1;
                            memcpy(&x0, xq, 4);
                            memcpy(&x1, xq + 32, 4);
                            const __m256i p0 = _mm256_maddubs_epi16(wl, _mm256_set1_epi32(x0));
                            const __m256i p1 = _mm256_maddubs_epi16(wh, _mm256_set1_epi32(x1));
                            acc[0][ii] = lg ? _mm256_add_epi16(acc[0][ii], p0) : p0;
                            acc[1][ii] = lg ? _mm256_add_epi16(acc[1][ii], p1) : p1;
                        }
                    }
                    for (int u = 0; u < 2; u++) {
                        const int64_t c = 8 * b + 2 * p + u;
                        for (int ii = 0; ii < n; ii++) {
                            const int64_t r = c * a->Mp + m0 + i0 + ii;
                            const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[u][ii], ones));
                            __m256 *fj = &f[h][u][i0 + ii];
                            /* both terms into one accumulator, as x16_rows_z */
                            *fj = _mm256_fmadd_ps(sum, _mm256_mul_ps(s[u], _mm256_set1_ps(a->d[r])),
                                                  *fj);
                            *fj = _mm256_fnmadd_ps(o[u], _mm256_set1_ps(a->dsum[r]), *fj);
                        }
                    }
                }
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(res + X16 * i + 8 * h, _mm256_add_ps(f[h][0][i], f[h][1][i]));
}

static void x16_rows(const uint8_t *grp, int64_t nb, const qacts *a, int64_t m0, int64_t K,
                     int mt, float *res)
{
#define CALL(k) x16_rows_y(grp, nb, a, m0, K, k, res)
    FOR_EACH_MTI(mt, CALL);
#undef CALL
}

/* AVX2 int4_x16 (layout: the int4_x16 section below): each 64-byte vector two ymm, rows 0-7
 * and 8-15; a chunk's 8 vpmaddubsw (4 vectors, low and high nibbles) sum exactly in int16 and
 * one vpmaddwd makes its 8 row sums, scaled once, as x16_rows_y. Activation rows go 2 at a
 * time (4 ran ~5% slower here, where x16_rows_y gained from them). */
#define X16I4Y_MT 2
static inline __attribute__((always_inline)) void
x16i4_rows_y(const wdesc *W, int64_t g, const qacts *a, int64_t m0, const int mt, float *res)
{
    const int64_t Kp = W->Kp, nchunk = Kp / CHUNK, G = Kp / W->group_size;
    const int64_t cpg = W->group_size / CHUNK;
    const uint8_t *grp = (const uint8_t *)W->w + g * X16 * (Kp / 2);
    const half *sc = W->scales + g * X16 * G, *of = W->offsets ? W->offsets + g * X16 * G : NULL;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 f[2][2][MTI]; /* [h][c & 1][i] */
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < mt; i++)
            f[h][0][i] = f[h][1][i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nchunk; c++) {
        const uint8_t *wc = grp + c * 4 * 64;
        prefetch_part(wc + X16I4_AHEAD, 0, 1, 4 * 64);
        const int64_t gi = c / cpg;
        for (int h = 0; h < 2; h++) {
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + X16 * gi + 8 * h)));
            const __m256 o = of ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(of + X16 * gi + 8 * h)))
                                : _mm256_mul_ps(s, _mm256_set1_ps(-8.f));
            for (int i0 = 0; i0 < mt; i0 += X16I4Y_MT) {
                const int n = mt - i0 < X16I4Y_MT ? mt - i0 : X16I4Y_MT;
                __m256i acc[X16I4Y_MT]; /* int16 */
                for (int lg = 0; lg < 4; lg++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(wc + 64 * lg + 32 * h));
                    const __m256i wl = _mm256_and_si256(q, m4);
                    const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    for (int ii = 0; ii < n; ii++) {
                        const int8_t *xq = a->q + (m0 + i0 + ii) * Kp + c * CHUNK + 4 * lg;
                        int32_t x0, x1;
                        memcpy(&x0, xq, 4);
                        memcpy(&x1, xq + 16, 4);
                        const __m256i p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(wl, _mm256_set1_epi32(x0)),
                            _mm256_maddubs_epi16(wh, _mm256_set1_epi32(x1)));
                        acc[ii] = lg ? _mm256_add_epi16(acc[ii], p) : p;
                    }
                }
                for (int ii = 0; ii < n; ii++) {
                    const int64_t r = c * a->Mp + m0 + i0 + ii;
                    const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[ii], ones));
                    __m256 *fc = &f[h][c & 1][i0 + ii]; /* both terms in one accumulator */
                    *fc = _mm256_fmadd_ps(sum, _mm256_mul_ps(s, _mm256_set1_ps(a->d[r])), *fc);
                    *fc = _mm256_fmadd_ps(o, _mm256_set1_ps(a->dsum[r]), *fc);
                }
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(res + X16 * i + 8 * h, _mm256_add_ps(f[h][0][i], f[h][1][i]));
}

static void x16i4_rows(const wdesc *W, int64_t g, const qacts *a, int64_t m0, int mt, float *res)
{
#define CALL(k) x16i4_rows_y(W, g, a, m0, k, res)
    FOR_EACH_MTI(mt, CALL);
#undef CALL
}

/* AVX2 q6_k_x16: one group's 16 rows against activation rows m0 .. m0 + mt (<= X16Q6_MT; int8
 * with per-16 sums): res[16 i + r]. Each 64-byte vector of the layout is two ymm, rows 0-7
 * (rh = 0) and 8-15 (rh = 1), taken in turn for every activation row of the tile (X16Q6_BOTH),
 * so a super-block's lines are walked once. Against taking a super-block's rows 0-7 and then,
 * from L1, its rows 8-15, on a Zen 4 (one process alternating two builds, 2 threads, 8192 x 2048
 * matrices cycled from DRAM): one activation row read 31.2 against 26.7 GB/s, two
 * 25.9 against 23.7; against the two-pass order for tiles of 3-4 rows, 3-4 rows 0-6% faster from
 * DRAM and 2-12% from cache, 8 and 32 rows 3-8%. The codes are unsigned (q, 0..63): a vpmaddubsw
 * adds a pair of products into each of a row's two int16 lanes, two of those sum exactly in
 * int16 (2 * 2 * 63 * 128 < 2^15), and one vpmaddwd against the sub-block's scales (each row's
 * sc_s in both of its lanes) widens them, so a chunk's two sub-blocks end in one exact int32 sum
 * per row, sum_s sc_s sum q x, converted and scaled by d d_x once; -32 d sc_s times the
 * activations' sum of each sub-block is added alongside (as x16q6_rows_z). The row kernel
 * q6k_row_i8 takes the file's layout, 32 inputs of one row per vector: a vector costs it a sign
 * split, a 32-byte activation load and a float step; here a broadcast of 4 activation bytes, and
 * the unpacking serves every activation row of the tile. A row's result does not depend on mt
 * (exact integer sums, its own accumulators, terms in a fixed order). */
static inline __attribute__((always_inline)) __m256i
x16q6_code_y(const uint8_t *sb, int h, int k, int lg, int rh)
{
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i ql = _mm256_loadu_si256(
        (const __m256i *)(sb + 64 * (16 * h + 8 * (k & 1) + lg) + 32 * rh));
    const __m256i qh = _mm256_loadu_si256(
        (const __m256i *)(sb + X16Q6_QH + 64 * (8 * h + lg) + 32 * rh));
    const __m256i lo = k < 2 ? _mm256_and_si256(ql, m4)
                             : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
    const __m256i hi = k == 0   ? _mm256_slli_epi16(qh, 4)
                       : k == 1 ? _mm256_slli_epi16(qh, 2)
                       : k == 2 ? qh
                                : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
}

static inline __attribute__((always_inline)) void
x16q6_rows_y(const uint8_t *grp, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int mt,
             float *res)
{
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const int nr = mt <= X16Q6_BOTH ? 2 : 1; /* row halves a pass */
    __m256 tot[2][X16Q6_MT]; /* [rh][i] */
    for (int rh = 0; rh < 2; rh++)
        for (int i = 0; i < mt; i++)
            tot[rh][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = grp + b * X16Q6_SB;
        for (int r0 = 0; r0 < 2; r0 += nr) {
            __m256 d[2], dm[2], f[2][X16Q6_MT];
            for (int q = 0; q < nr; q++) {
                d[q] = _mm256_cvtph_ps(
                    _mm_loadu_si128((const __m128i *)(sb + X16Q6_D + 16 * (r0 + q))));
                dm[q] = _mm256_mul_ps(d[q], _mm256_set1_ps(-32.f));
                for (int i = 0; i < mt; i++)
                    f[q][i] = _mm256_setzero_ps();
            }
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 4; k++) { /* chunk c: inputs 128 h + 32 k .. + 31 */
                    const int64_t c = 8 * b + 4 * h + k;
                    const int8_t *xc = a->q + m0 * K + c * 32;
                    if (r0 == 0)
                        prefetch_part(sb + X16Q6_AHEAD, 4 * h + k, 8, X16Q6_SB);
                    __m256i acc[2][X16Q6_MT];
                    for (int q = 0; q < nr; q++)
                        for (int i = 0; i < mt; i++)
                            acc[q][i] = _mm256_setzero_si256();
                    for (int half = 0; half < 2; half++) { /* sub-block 8 h + 2 k + half */
                        const uint8_t *sc = sb + X16Q6_SC + 16 * (8 * h + 2 * k + half) + 8 * r0;
                        __m256i sp[2];
                        for (int q = 0; q < nr; q++)
                            sp[q] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
                                _mm_loadl_epi64((const __m128i *)(sc + 8 * q)), dup));
                        for (int lg = 4 * half; lg < 4 * half + 4; lg += 2)
                            for (int q = 0; q < nr; q++) {
                                const __m256i v0 = x16q6_code_y(sb, h, k, lg, r0 + q);
                                const __m256i v1 = x16q6_code_y(sb, h, k, lg + 1, r0 + q);
                                for (int i = 0; i < mt; i++) {
                                    int32_t x0, x1;
                                    memcpy(&x0, xc + i * K + 4 * lg, 4);
                                    memcpy(&x1, xc + i * K + 4 * lg + 4, 4);
                                    const __m256i p = _mm256_add_epi16(
                                        _mm256_maddubs_epi16(v0, _mm256_set1_epi32(x0)),
                                        _mm256_maddubs_epi16(v1, _mm256_set1_epi32(x1)));
                                    acc[q][i] = _mm256_add_epi32(acc[q][i],
                                                                 _mm256_madd_epi16(p, sp[q]));
                                }
                            }
                    }
                    for (int q = 0; q < nr; q++) {
                        const uint8_t *sc = sb + X16Q6_SC + 16 * (8 * h + 2 * k) + 8 * (r0 + q);
                        const __m256 o0 = _mm256_mul_ps(dm[q], _mm256_cvtepi32_ps(
                            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
                        const __m256 o1 = _mm256_mul_ps(dm[q], _mm256_cvtepi32_ps(
                            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16)))));
                        for (int i = 0; i < mt; i++) {
                            const int64_t r = m0 + i;
                            __m256 *fi = &f[q][i];
                            *fi = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(acc[q][i]),
                                _mm256_mul_ps(d[q], _mm256_set1_ps(a->d[c * a->Mp + r])), *fi);
                            *fi = _mm256_fmadd_ps(
                                o0, _mm256_set1_ps(a->dsum16[2 * c * a->Mp + r]), *fi);
                            *fi = _mm256_fmadd_ps(
                                o1, _mm256_set1_ps(a->dsum16[(2 * c + 1) * a->Mp + r]), *fi);
                        }
                    }
                }
            for (int q = 0; q < nr; q++)
                for (int i = 0; i < mt; i++)
                    tot[r0 + q][i] = _mm256_add_ps(tot[r0 + q][i], f[q][i]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int rh = 0; rh < 2; rh++)
            _mm256_storeu_ps(res + X16 * i + 8 * rh, tot[rh][i]);
}

/* The AVX2 int8 GEMM's tiles (gemm_pack_tile's layout, 8 rows: tile[c][j] lane r = row n0 + r,
 * inputs 32 c + 4 j .. + 3) straight from the _x16 layouts: rows n0 .. n0 + 7 are one ymm half
 * (rh) of each 64-byte vector, so a tile vector is a load and a nibble (and for q6_k_x16 the
 * top-bit) split; reading each row's codes back with gathers (codes_x16) and transposing them
 * made the GEMM 5-10% slower at 128 activation rows (Q4_K and int4 on a Zen 4). The same
 * codes and per-16 scales and offsets as gemm_codes_row gives, so the same results. */
#define X16Y_GT 8 /* the AVX2 GEMM's tile rows (GT) */
static void x16_pack_tile(const wdesc *W, int64_t n0, int64_t c0, int64_t cn, uint8_t *tile,
                          float *sw, float *ow)
{
    const uint8_t *grp = (const uint8_t *)W->w + n0 / X16 * X16 * W->row_bytes;
    const int rh = (int)(n0 % X16) / 8;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256 neg = _mm256_set1_ps(-0.f);
    for (int64_t b = c0 / 8; b < (c0 + cn) / 8; b++) {
        const uint8_t *sb = grp + b * X16_SB;
        for (int p = 0; p < 4; p++) {
            uint8_t *lo = tile + (8 * b + 2 * p - c0) * 8 * 32; /* chunk 2p's 8 vectors */
            for (int lg = 0; lg < 8; lg++) {
                const __m256i q = _mm256_loadu_si256(
                    (const __m256i *)(sb + X16_QS + 512 * p + 64 * lg + 32 * rh));
                _mm256_store_si256((__m256i *)(lo + 32 * lg), _mm256_and_si256(q, m4));
                _mm256_store_si256((__m256i *)(lo + 256 + 32 * lg),
                                   _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * rh)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 32 + 16 * rh)));
        uint8_t sc[128], mn[128];
        x16_scales(sb, sc, mn);
        for (int j = 0; j < 8; j++) {
            const int64_t h = 2 * (8 * b + j - c0); /* the chunk's two 16-input halves */
            const __m256 sv = _mm256_mul_ps(d, u8_to_ps(
                _mm_loadl_epi64((const __m128i *)(sc + 16 * j + 8 * rh))));
            const __m256 ov = _mm256_xor_ps(neg, _mm256_mul_ps(dmin, u8_to_ps( /* -(dmin m) */
                _mm_loadl_epi64((const __m128i *)(mn + 16 * j + 8 * rh)))));
            _mm256_store_ps(sw + h * X16Y_GT, sv);
            _mm256_store_ps(sw + (h + 1) * X16Y_GT, sv);
            _mm256_store_ps(ow + h * X16Y_GT, ov);
            _mm256_store_ps(ow + (h + 1) * X16Y_GT, ov);
        }
    }
}

static void x16q6_pack_tile(const wdesc *W, int64_t n0, int64_t c0, int64_t cn, uint8_t *tile,
                            float *sw, float *ow)
{
    const uint8_t *grp = (const uint8_t *)W->w + n0 / X16 * X16 * W->row_bytes;
    const int rh = (int)(n0 % X16) / 8;
    for (int64_t b = c0 / 8; b < (c0 + cn) / 8; b++) {
        const uint8_t *sb = grp + b * X16Q6_SB;
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int lg = 0; lg < 8; lg++) /* chunk 8b + 4h + k, vector lg */
                    _mm256_store_si256((__m256i *)(tile + ((8 * b + 4 * h + k - c0) * 8 + lg) * 32),
                                       x16q6_code_y(sb, h, k, lg, rh));
        const __m256 d = _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(sb + X16Q6_D + 16 * rh)));
        for (int s = 0; s < 16; s++) { /* half 2 (8b - c0) + s in the tile's order */
            const int64_t hx = 2 * (8 * b - c0) + s;
            _mm256_store_ps(sw + hx * X16Y_GT, _mm256_mul_ps(d, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    (const __m128i *)(sb + X16Q6_SC + 16 * s + 8 * rh))))));
            _mm256_store_ps(ow + hx * X16Y_GT, _mm256_setzero_ps());
        }
    }
}

static void x16i4_pack_tile(const wdesc *W, int64_t n0, int64_t c0, int64_t cn, uint8_t *tile,
                            float *sw, float *ow)
{
    const int64_t Kp = W->Kp, G = Kp / W->group_size, cpg = W->group_size / CHUNK;
    const int64_t g0 = n0 / X16 * X16;
    const int rh = (int)(n0 % X16) / 8;
    const uint8_t *grp = (const uint8_t *)W->w + g0 * (Kp / 2);
    const half *sc = W->scales + g0 * G, *of = W->offsets ? W->offsets + g0 * G : NULL;
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t c = c0; c < c0 + cn; c++) {
        uint8_t *t = tile + (c - c0) * 8 * 32;
        for (int lg = 0; lg < 4; lg++) {
            const __m256i q =
                _mm256_loadu_si256((const __m256i *)(grp + (c * 4 + lg) * 64 + 32 * rh));
            _mm256_store_si256((__m256i *)(t + 32 * lg), _mm256_and_si256(q, m4));
            _mm256_store_si256((__m256i *)(t + 32 * (4 + lg)),
                               _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
        }
        const int64_t gi = c / cpg, h = 2 * (c - c0);
        const __m256 s =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + X16 * gi + 8 * rh)));
        const __m256 o = /* symmetric: the zero point 8 (traits) */
            of ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(of + X16 * gi + 8 * rh)))
               : _mm256_setzero_ps();
        _mm256_store_ps(sw + h * X16Y_GT, s);
        _mm256_store_ps(sw + (h + 1) * X16Y_GT, s);
        _mm256_store_ps(ow + h * X16Y_GT, o);
        _mm256_store_ps(ow + (h + 1) * X16Y_GT, o);
    }
}

#endif /* !HAVE_ZMM_PATH */

#endif /* HAVE_I8_PATH */

#ifdef HAVE_ZMM_PATH
/* One group's 16 rows against activation rows m0 .. m0 + mt (int8, ACT_PLAIN): res[16 i + r].
 * np qs runs at once keep enough independent vpdpbusd chains in flight for one to three
 * activation rows (from four on, the rows themselves do), and each row's four float
 * accumulators enough fma chains. Two runs, not four, for a single row: the loads then walk
 * two streams 512 bytes apart rather than four, which the hardware prefetchers follow better
 * from DRAM. On a Zen 4 (1B Q4_K_M, 16 layers' gate_up cycled, one process alternating
 * builds) one thread read 17.9 against 12.9 GB/s, two 27.3 against 23.6, and batch-1 decode
 * rose 31.9 -> 38.2 tok/s; one run (np 1) read as two. A row's arithmetic is the same
 * whatever mt: its integer sums are exact, and each accumulator takes its terms in the same
 * order, so its result does not depend on the rows beside it. */
static inline __attribute__((always_inline)) void
x16_rows_z(const uint8_t *grp, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int mt,
           float *res)
{
    const int np = mt <= 3 ? 2 : 1, na = 4;
    __m512 f[4][MTI];
    for (int k = 0; k < na; k++)
        for (int i = 0; i < mt; i++)
            f[k][i] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = grp + b * X16_SB;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32)));
        uint8_t scs[128], mns[128];
        x16_scales(sb, scs, mns);
        for (int p0 = 0; p0 < 4; p0 += np) {
            if (np == 1) /* a quarter of the super-block a step (np 2: a line at each load) */
                prefetch_part(sb + X16Q4_AHEAD, p0, 4, X16_SB);
            __m512i acc[4][2][MTI]; /* [p - p0][u][i] */
            for (int pp = 0; pp < np; pp++)
                for (int i = 0; i < mt; i++)
                    acc[pp][0][i] = acc[pp][1][i] = _mm512_setzero_si512();
            for (int lg = 0; lg < 8; lg++) {
                if (np == 2)
                    prefetch_part(sb + X16Q4_AHEAD, p0 / 2 * 8 + lg, 16, X16_SB);
                for (int pp = 0; pp < np; pp++) {
                    const int p = p0 + pp;
                    const __m512i q = _mm512_loadu_si512(sb + X16_QS + 512 * p + 64 * lg);
                    const __m512i wl = _mm512_and_si512(q, m4);
                    const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                    for (int i = 0; i < mt; i++) {
                        const int8_t *xq = a->q + (m0 + i) * K + b * QK_K + 64 * p + 4 * lg;
                        int32_t x0, x1;
                        memcpy(&x0, xq, 4);
                        memcpy(&x1, xq + 32, 4);
                        acc[pp][0][i] = _mm512_dpbusd_epi32(acc[pp][0][i], wl, _mm512_set1_epi32(x0));
                        acc[pp][1][i] = _mm512_dpbusd_epi32(acc[pp][1][i], wh, _mm512_set1_epi32(x1));
                    }
                }
            }
            for (int pp = 0; pp < np; pp++)
                for (int u = 0; u < 2; u++) {
                    const int j = 2 * (p0 + pp) + u;
                    const int64_t c = 8 * b + j;
                    const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(scs + 16 * j)))));
                    const __m512 o = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(mns + 16 * j)))));
                    for (int i = 0; i < mt; i++) {
                        const float dx = a->d[c * a->Mp + m0 + i], ds = a->dsum[c * a->Mp + m0 + i];
                        /* both terms into one accumulator: the min term cancels much of the
                         * scale term, and two separate sums would each grow to the size of
                         * the terms, their rounding with them */
                        __m512 *fj = &f[j % na][i];
                        *fj = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[pp][u][i]),
                                              _mm512_mul_ps(s, _mm512_set1_ps(dx)), *fj);
                        *fj = _mm512_fnmadd_ps(o, _mm512_set1_ps(ds), *fj);
                    }
                }
        }
    }
    for (int i = 0; i < mt; i++) {
        __m512 t = f[0][i];
        for (int k = 1; k < na; k++)
            t = _mm512_add_ps(t, f[k][i]);
        _mm512_storeu_ps(res + X16 * i, t);
    }
}

static void x16_rows(const uint8_t *grp, int64_t nb, const qacts *a, int64_t m0, int64_t K,
                     int mt, float *res)
{
#define CALL(k) x16_rows_z(grp, nb, a, m0, K, k, res)
    FOR_EACH_MTI(mt, CALL);
#undef CALL
}

static void x16i4_rows(const wdesc *W, int64_t g, const qacts *a, int64_t m0, int mt, float *res);

/* Chunks c0 .. c0 + cn (whole super-blocks) of the 16 rows from n0 (a group) as the int8 GEMM's
 * tile, scales and offsets (gemm_pack_tile's layout): the low and high nibbles of each 64-byte
 * load are already a tile vector each. */
static void x16_pack_tile(const wdesc *W, int64_t n0, int64_t c0, int64_t cn, uint8_t *tile,
                          float *sw, float *ow)
{
    const uint8_t *grp = (const uint8_t *)W->w + n0 * W->row_bytes;
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512 neg = _mm512_set1_ps(-0.f);
    for (int64_t b = c0 / 8; b < (c0 + cn) / 8; b++) {
        const uint8_t *sb = grp + b * X16_SB;
        for (int p = 0; p < 4; p++) {
            uint8_t *lo = tile + (8 * b + 2 * p - c0) * 8 * 64; /* chunk 2p's 8 vectors */
            for (int lg = 0; lg < 8; lg++) {
                const __m512i q = _mm512_loadu_si512(sb + X16_QS + 512 * p + 64 * lg);
                _mm512_store_si512(lo + 64 * lg, _mm512_and_si512(q, m4));
                _mm512_store_si512(lo + 512 + 64 * lg,
                                   _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32)));
        uint8_t sc[128], mn[128];
        x16_scales(sb, sc, mn);
        for (int j = 0; j < 8; j++) {
            const int64_t h = 2 * (8 * b + j - c0); /* the chunk's two 16-input halves */
            const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(sc + 16 * j)))));
            const __m512 o = _mm512_xor_ps(neg, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mn + 16 * j))))));
            _mm512_store_ps(sw + h * X16, s);
            _mm512_store_ps(sw + (h + 1) * X16, s);
            _mm512_store_ps(ow + h * X16, o);
            _mm512_store_ps(ow + (h + 1) * X16, o);
        }
    }
}

/* The 4 code vectors (f = 0..3) of qs run lg of half h: 16 rows x 4 inputs each */
static inline __attribute__((always_inline)) void
x16q6_codes(const uint8_t *sb, int h, int lg, __m512i v[4])
{
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i qa = _mm512_loadu_si512(sb + 64 * (16 * h + lg));
    const __m512i qb = _mm512_loadu_si512(sb + 64 * (16 * h + 8 + lg));
    const __m512i qh = _mm512_loadu_si512(sb + X16Q6_QH + 64 * (8 * h + lg));
#define PICK(lo, hi) _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_and_si512(hi, m30))
    v[0] = PICK(qa, _mm512_slli_epi16(qh, 4));
    v[1] = PICK(qb, _mm512_slli_epi16(qh, 2));
    v[2] = PICK(_mm512_srli_epi16(qa, 4), qh);
    v[3] = PICK(_mm512_srli_epi16(qb, 4), _mm512_srli_epi16(qh, 2));
#undef PICK
}

/* One group's 16 rows against activation rows m0 .. m0 + mt (<= X16Q6_MT; int8 with per-16
 * sums): res[16 i + r]. A half's 8 runs go 4 at a time (4 vpdpbusd chains a row and f). One
 * row took all 8 at once, which reads three streams at twice the spread: from DRAM on a Zen 4
 * (1B Q4_K_M, one process alternating builds, with x16_rows_z's two runs) two threads read
 * the down projections at 27.2 against 23.5 GB/s that way, batch-1 decode 43.4 against 39.0
 * tok/s. The float accumulators (one per f) take their terms in a fixed order, so a row's
 * result does not depend on the rows beside it. */
static inline __attribute__((always_inline)) void
x16q6_rows_z(const uint8_t *grp, int64_t nb, const qacts *a, int64_t m0, int64_t K, const int mt,
             float *res)
{
    __m512 f[4][X16Q6_MT];
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < mt; i++)
            f[k][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = grp + b * X16Q6_SB;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + X16Q6_D)));
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++) {
                prefetch_part(sb + X16Q6_AHEAD, 2 * h + half, 4, X16Q6_SB);
                __m512i acc[4][X16Q6_MT]; /* [f][i] */
                for (int k = 0; k < 4; k++)
                    for (int i = 0; i < mt; i++)
                        acc[k][i] = _mm512_setzero_si512();
                for (int lg = 4 * half; lg < 4 * half + 4; lg++) {
                    __m512i v[4];
                    x16q6_codes(sb, h, lg, v);
                    for (int i = 0; i < mt; i++)
                        for (int k = 0; k < 4; k++) {
                            int32_t x4;
                            memcpy(&x4, a->q + (m0 + i) * K + b * QK_K + 128 * h + 32 * k + 4 * lg,
                                   4);
                            acc[k][i] = _mm512_dpbusd_epi32(acc[k][i], v[k],
                                                            _mm512_set1_epi32(x4));
                        }
                }
                for (int k = 0; k < 4; k++) {
                    const int s = 8 * h + 2 * k + half;
                    const int64_t c = 8 * b + 4 * h + k;
                    const __m512 sv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(sb + X16Q6_SC + 16 * s)))));
                    const __m512 ov = _mm512_mul_ps(sv, _mm512_set1_ps(-32.f));
                    for (int i = 0; i < mt; i++) {
                        const float dx = a->d[c * a->Mp + m0 + i];
                        const float ds = a->dsum16[(2 * c + half) * a->Mp + m0 + i];
                        f[k][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k][i]),
                                                  _mm512_mul_ps(sv, _mm512_set1_ps(dx)), f[k][i]);
                        f[k][i] = _mm512_fmadd_ps(ov, _mm512_set1_ps(ds), f[k][i]);
                    }
                }
            }
    }
    for (int i = 0; i < mt; i++)
        _mm512_storeu_ps(res + X16 * i, _mm512_add_ps(_mm512_add_ps(f[0][i], f[1][i]),
                                                      _mm512_add_ps(f[2][i], f[3][i])));
}

/* x16_pack_tile for q6_k_x16 (no offsets: zero point 32) */
static void x16q6_pack_tile(const wdesc *W, int64_t n0, int64_t c0, int64_t cn, uint8_t *tile,
                            float *sw, float *ow)
{
    const uint8_t *grp = (const uint8_t *)W->w + n0 * W->row_bytes;
    for (int64_t b = c0 / 8; b < (c0 + cn) / 8; b++) {
        const uint8_t *sb = grp + b * X16Q6_SB;
        for (int h = 0; h < 2; h++)
            for (int lg = 0; lg < 8; lg++) {
                __m512i v[4];
                x16q6_codes(sb, h, lg, v);
                for (int k = 0; k < 4; k++) /* chunk 8b + 4h + k, vector lg */
                    _mm512_store_si512(tile + ((8 * b + 4 * h + k - c0) * 8 + lg) * 64, v[k]);
            }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + X16Q6_D)));
        for (int s = 0; s < 16; s++) { /* half 2 (8b - c0) + s in the tile's order */
            const int64_t hx = 2 * (8 * b - c0) + s;
            _mm512_store_ps(sw + hx * X16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + X16Q6_SC + 16 * s))))));
            _mm512_store_ps(ow + hx * X16, _mm512_setzero_ps());
        }
    }
}

/* ---- int4_x16: qserve's int4 with 16 rows interleaved, alike ----------------------------------
 * qweight, Kp / 2 bytes a row as for int4: group g's chunk c (32 inputs) is 4 vectors of 64 bytes,
 * [lg][r][t] = row r's codes of inputs 32c + 4 lg + t (low nibble) and 32c + 16 + 4 lg + t
 * (high); scales and offsets fp16, [G][16] per group of rows (qserve/formats/ggml.py).
 * w = q s + o (asymmetric), (q - 8) s (symmetric), as int4. */
static inline __attribute__((always_inline)) void
x16i4_rows_z(const wdesc *W, int64_t g, const qacts *a, int64_t m0, const int mt, float *res)
{
    const int64_t Kp = W->Kp, nchunk = Kp / CHUNK, G = Kp / W->group_size;
    const int64_t cpg = W->group_size / CHUNK;
    const uint8_t *grp = (const uint8_t *)W->w + g * X16 * (Kp / 2);
    const half *sc = W->scales + g * X16 * G, *of = W->offsets ? W->offsets + g * X16 * G : NULL;
    const int nc = mt == 1 ? 4 : mt <= 3 ? 2 : 1; /* chunks at once: 2 nc vpdpbusd chains a row */
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512 f[4][MTI];
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < mt; i++)
            f[k][i] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < nchunk; c0 += nc) {
        __m512i lo[4][MTI], hi[4][MTI];
        for (int cc = 0; cc < nc; cc++) {
            const int64_t c = c0 + cc;
            if (c >= nchunk)
                break;
            const uint8_t *wc = grp + c * 4 * 64;
            for (int i = 0; i < mt; i++)
                lo[cc][i] = hi[cc][i] = _mm512_setzero_si512();
            for (int lg = 0; lg < 4; lg++) {
                _mm_prefetch((const char *)(wc + X16I4_AHEAD + 64 * lg), _MM_HINT_T0);
                const __m512i q = _mm512_loadu_si512(wc + 64 * lg);
                const __m512i wl = _mm512_and_si512(q, m4);
                const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                for (int i = 0; i < mt; i++) {
                    const int8_t *xq = a->q + (m0 + i) * Kp + c * CHUNK + 4 * lg;
                    int32_t x0, x1;
                    memcpy(&x0, xq, 4);
                    memcpy(&x1, xq + 16, 4);
                    lo[cc][i] = _mm512_dpbusd_epi32(lo[cc][i], wl, _mm512_set1_epi32(x0));
                    hi[cc][i] = _mm512_dpbusd_epi32(hi[cc][i], wh, _mm512_set1_epi32(x1));
                }
            }
        }
        for (int cc = 0; cc < nc; cc++) {
            const int64_t c = c0 + cc;
            if (c >= nchunk)
                break;
            const int64_t gi = c / cpg;
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + X16 * gi)));
            const __m512 o = of ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(of + X16 * gi)))
                                : _mm512_mul_ps(s, _mm512_set1_ps(-8.f));
            const int k = (int)(c & 3); /* both terms in one accumulator, as x16_rows_z */
            for (int i = 0; i < mt; i++) {
                const float dx = a->d[c * a->Mp + m0 + i], ds = a->dsum[c * a->Mp + m0 + i];
                f[k][i] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_add_epi32(lo[cc][i], hi[cc][i])),
                    _mm512_mul_ps(s, _mm512_set1_ps(dx)), f[k][i]);
                f[k][i] = _mm512_fmadd_ps(o, _mm512_set1_ps(ds), f[k][i]);
            }
        }
    }
    for (int i = 0; i < mt; i++)
        _mm512_storeu_ps(res + X16 * i, _mm512_add_ps(_mm512_add_ps(f[0][i], f[1][i]),
                                                      _mm512_add_ps(f[2][i], f[3][i])));
}

static void x16i4_rows(const wdesc *W, int64_t g, const qacts *a, int64_t m0, int mt, float *res)
{
#define CALL(k) x16i4_rows_z(W, g, a, m0, k, res)
    FOR_EACH_MTI(mt, CALL);
#undef CALL
}


/* The int8 GEMM's tile of int4_x16 rows n0 .. n0 + 15, chunks c0 .. c0 + cn: each 64-byte
 * vector's low nibbles are tile vector lg of its chunk, its high nibbles vector 4 + lg. */
static void x16i4_pack_tile(const wdesc *W, int64_t n0, int64_t c0, int64_t cn, uint8_t *tile,
                            float *sw, float *ow)
{
    const int64_t Kp = W->Kp, G = Kp / W->group_size, cpg = W->group_size / CHUNK;
    const uint8_t *grp = (const uint8_t *)W->w + n0 * (Kp / 2);
    const half *sc = W->scales + n0 * G, *of = W->offsets ? W->offsets + n0 * G : NULL;
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int64_t c = c0; c < c0 + cn; c++) {
        uint8_t *t = tile + (c - c0) * 8 * 64;
        for (int lg = 0; lg < 4; lg++) {
            const __m512i q = _mm512_loadu_si512(grp + (c * 4 + lg) * 64);
            _mm512_store_si512(t + 64 * lg, _mm512_and_si512(q, m4));
            _mm512_store_si512(t + 64 * (4 + lg), _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
        }
        const int64_t gi = c / cpg, h = 2 * (c - c0);
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + X16 * gi)));
        const __m512 o = of ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(of + X16 * gi)))
                            : _mm512_setzero_ps(); /* symmetric: the zero point 8 (traits) */
        _mm512_store_ps(sw + h * X16, s);
        _mm512_store_ps(sw + (h + 1) * X16, s);
        _mm512_store_ps(ow + h * X16, o);
        _mm512_store_ps(ow + (h + 1) * X16, o);
    }
}
#endif /* HAVE_ZMM_PATH */

#ifdef HAVE_I8_PATH
/* q6_k_x16's row kernel (512-bit or AVX2) specialized for each tile height */
static void x16q6_rows(const uint8_t *grp, int64_t nb, const qacts *a, int64_t m0, int64_t K,
                       int mt, float *res)
{
#ifdef HAVE_ZMM_PATH
#define X16Q6_ROWS(k) x16q6_rows_z(grp, nb, a, m0, K, k, res)
#else
#define X16Q6_ROWS(k) x16q6_rows_y(grp, nb, a, m0, K, k, res)
#endif
    switch (mt) {
    case 1: X16Q6_ROWS(1); break;
    case 2: X16Q6_ROWS(2); break;
    case 3: X16Q6_ROWS(3); break;
    default: X16Q6_ROWS(X16Q6_MT);
    }
#undef X16Q6_ROWS
}

/* Row n of a q4_k_x16 / q6_k_x16 / int4_x16 W */
static void x16_any_dequant_row(const wdesc *W, int64_t n, float *out)
{
    if (W->kind == KIND_Q6_K_X16)
        x16q6_dequant_row(W, n, out);
    else if (W->kind == KIND_INT4_X16)
        x16i4_dequant_row(W, n, out);
    else
        x16_dequant_row(W, n, out);
}

/* y = x W^T (+ bias) for a q4_k_x16 / q6_k_x16 / int4_x16 W: with int8 activations 16 rows at
 * a time (x16_rows, x16q6_rows, x16i4_rows: 512-bit or AVX2); with fp32 ones,
 * each row dequantized (as wdequant) and dotted with every activation row. */
static void x16_matmul(const wdesc *W, const float *x, int64_t M, int64_t ldx, float *y,
                       int64_t ldy, int i8, int nthreads)
{
    const int q6 = W->kind == KIND_Q6_K_X16, i4 = W->kind == KIND_INT4_X16;
    const int tile = q6 ? X16Q6_MT : MTI;
    const int64_t nb = W->K / QK_K, groups = W->N / X16, Kp = i4 ? W->Kp : W->K;
    const int64_t rb = i4 ? W->Kp / 2 : W->row_bytes; /* int4: row_bytes is not set */
    const int64_t item = row_item(X16 * rb) / ROW_ITEM; /* groups of ~32 KB */
    if (!i8) {
#pragma omp parallel num_threads(nthreads)
        {
            float *w = aligned_alloc(64, sizeof(float) * (size_t)((W->K + 15) / 16 * 16));
#pragma omp for schedule(dynamic, item * X16)
            for (int64_t n = 0; n < W->N; n++) {
                x16_any_dequant_row(W, n, w);
                for (int64_t m = 0; m < M; m++)
                    y[m * ldy + n] = dot(w, x + m * ldx, (int)W->K) + (W->bias ? W->bias[n] : 0.f);
            }
            free(w);
        }
        return;
    }
    qacts a = quantize_activations(x, M, W->K, ldx, Kp, ACT_PLAIN, q6, nthreads);
    /* guided: runs of consecutive groups, each the groups left over the threads (half the
     * matrix first, on two) down to 4, still taken as threads ask, so they finish nearer
     * together than with 8 equal runs: 1B Q4_K_M at batch 1 (Zen 4, 2 threads) waited at the
     * matmuls' ends 4.7-5.3% of the wall, 2.4-3.0% so; 1B-shaped matrices from DRAM at 1 row
     * +2-4% GB/s, with a busy process beside them +2% (one process alternating builds). */
#pragma omp parallel for num_threads(nthreads) schedule(guided, 4)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *grp = (const uint8_t *)W->w + g * X16 * W->row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += tile) {
            float res[MTI * X16] __attribute__((aligned(64)));
            const int mt = M - m0 < tile ? (int)(M - m0) : tile;
            if (i4)
                x16i4_rows(W, g, &a, m0, mt, res);
            else if (q6)
                x16q6_rows(grp, nb, &a, m0, W->K, mt, res);
            else
                x16_rows(grp, nb, &a, m0, W->K, mt, res);
            for (int i = 0; i < mt; i++) /* 8 rows at a time: a ymm on either ISA */
                for (int h = 0; h < X16; h += 8) {
                    const int64_t n = X16 * g + h;
                    const __m256 bias = W->bias ? _mm256_loadu_ps(W->bias + n) : _mm256_setzero_ps();
                    _mm256_storeu_ps(y + (m0 + i) * ldy + n,
                                     _mm256_add_ps(_mm256_load_ps(res + X16 * i + h), bias));
                }
        }
    }
    free_activations(a);
}
#endif /* HAVE_I8_PATH */

/* ---- laying out: q4_k / q6_k / int4 -> q4_k_x16 / q6_k_x16 / int4_x16 ----------------------
 * qserve/formats/ggml.py interleave (the reference) makes these bytes in torch, with a
 * permuted copy of every field and a cat of them; here each 16-row group's bytes are moved
 * straight from the file's rows to their place in the destination (a large matrix's stack,
 * written a slice at a time by a load: QuantLinear.laid_out), with no temporaries. Portable
 * C: whichever ISA runs the layouts, laying them out is byte moves. A 4-byte run c of a row
 * (qs, ql, qh) goes to word [c][r] of its group: 4 (16 c + r) bytes in. */
#define LAY_ROWS 16

/* q4_k: super-block b of a group's 16 rows (row r at src + r * ld) -> its X16 super-block
 * (d[16] | dmin[16] | lo[8][16] | hi[4][16] | qs[32][16][4]; 16 x 144 bytes) */
static void lay_q4_k_x16(const uint8_t *src, int64_t ld, uint8_t *dst)
{
    for (int r = 0; r < LAY_ROWS; r++) {
        const uint8_t *b = src + r * ld;
        uint32_t w[4];
        uint8_t sm[16]; /* 8 scales, then 8 mins, unpacked as _k_scale_min does */
        k4_words(b + 4, w);
        memcpy(sm, w, sizeof sm);
        memcpy(dst + 2 * r, b, 2);
        memcpy(dst + 32 + 2 * r, b + 2, 2);
        for (int j = 0; j < 8; j++)
            dst[64 + LAY_ROWS * j + r] = (uint8_t)((sm[j] & 15) | (sm[8 + j] & 15) << 4);
        for (int i = 0; i < 4; i++)
            dst[192 + LAY_ROWS * i + r] = (uint8_t)(sm[2 * i] >> 4 | (sm[8 + 2 * i] >> 4) << 2 |
                                                    (sm[2 * i + 1] >> 4) << 4 |
                                                    (sm[9 + 2 * i] >> 4) << 6);
        for (int c = 0; c < 32; c++)
            memcpy(dst + 256 + 4 * (LAY_ROWS * c + r), b + 16 + 4 * c, 4);
    }
}

/* q6_k: alike (ql[32][16][4] | qh[16][16][4] | sc[16][16] | d[16] | 32 zero bytes;
 * 16 x 212 bytes) */
static void lay_q6_k_x16(const uint8_t *src, int64_t ld, uint8_t *dst)
{
    for (int r = 0; r < LAY_ROWS; r++) {
        const uint8_t *b = src + r * ld;
        for (int c = 0; c < 32; c++)
            memcpy(dst + 4 * (LAY_ROWS * c + r), b + 4 * c, 4);
        for (int c = 0; c < 16; c++)
            memcpy(dst + 2048 + 4 * (LAY_ROWS * c + r), b + 128 + 4 * c, 4);
        for (int s = 0; s < 16; s++)
            dst[3072 + LAY_ROWS * s + r] = b[192 + s];
        memcpy(dst + 3328 + 2 * r, b + 208, 2);
    }
    memset(dst + 3360, 0, 32);
}

/* int4: a group's 16 rows (row r at src + r * ld, Kp / 2 bytes) -> its 8 Kp bytes: chunk c of
 * 32 inputs is [lg][r][t] = row r's codes of inputs 32 c + k (low nibble) and 32 c + 16 + k
 * (high), k = 4 lg + t. A row's byte j holds inputs 2j (low) and 2j + 1 (high), so input k's
 * byte is k / 2 and input 16 + k's 8 + k / 2, both in nibble k % 2. */
static void lay_int4_x16(const uint8_t *src, int64_t ld, int64_t Kp, uint8_t *dst)
{
    for (int r = 0; r < LAY_ROWS; r++)
        for (int64_t c = 0; c < Kp / 32; c++) {
            const uint8_t *q = src + r * ld + 16 * c;
            uint8_t *o = dst + 256 * c + 4 * r;
            for (int k = 0; k < 16; k += 2) {
                const uint8_t lo = q[k / 2], hi = q[8 + k / 2];
                o[64 * (k / 4) + k % 4] = (uint8_t)((lo & 15) | (hi << 4));
                o[64 * (k / 4) + k % 4 + 1] = (uint8_t)((lo >> 4) | (hi & 0xf0));
            }
        }
}

/* A group's (16, G) scales or offsets (row r at src + r * G) -> [G][16] */
static void lay_groups_x16(const half *src, int64_t G, half *dst)
{
    for (int r = 0; r < LAY_ROWS; r++)
        for (int64_t j = 0; j < G; j++)
            dst[LAY_ROWS * j + r] = src[r * G + j];
}

/* Rows 0 .. S->N of S (q4_k, q6_k or int4; N a multiple of 16, rows S->row_bytes apart, int4's
 * scales and offsets contiguous) -> rows r0 .. r0 + S->N of D, a contiguous matrix of their
 * _x16 kind with as many inputs (int4: padded inputs, groups and offsets). D is written,
 * though a wdesc's pointers are const for the kernels that read it. Returns 0, or -1 where the
 * kinds, shapes or rows do not fit (nothing written). */
int x16_interleave(const wdesc *S, const wdesc *D, int64_t r0, int nthreads)
{
    const int64_t n = S->N, K = S->K, nb = K / QK_K;
    if (n % LAY_ROWS || r0 % LAY_ROWS || r0 < 0 || r0 + n > D->N || D->K != K)
        return -1;
    switch (S->kind) {
    case KIND_Q4_K:
        if (D->kind != KIND_Q4_K_X16 || K % QK_K || D->row_bytes != nb * 144)
            return -1;
        break;
    case KIND_Q6_K:
        if (D->kind != KIND_Q6_K_X16 || K % QK_K || D->row_bytes != nb * 212)
            return -1;
        break;
    case KIND_INT4:
        if (D->kind != KIND_INT4_X16 || S->Kp != D->Kp || S->Kp % 32
            || S->group_size != D->group_size || D->row_bytes != D->Kp / 2 || !S->scales
            || !D->scales || !S->offsets != !D->offsets)
            return -1;
        break;
    default:
        return -1;
    }
    uint8_t *dw = (uint8_t *)D->w + r0 * D->row_bytes;
    const uint8_t *sw = (const uint8_t *)S->w;
    const int64_t ld = S->row_bytes, groups = n / LAY_ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (groups >= 16)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *src = sw + g * LAY_ROWS * ld;
        uint8_t *dst = dw + g * LAY_ROWS * D->row_bytes;
        if (S->kind == KIND_INT4) {
            const int64_t G = S->Kp / S->group_size, at = (r0 + g * LAY_ROWS) * G;
            lay_int4_x16(src, ld, S->Kp, dst);
            lay_groups_x16(S->scales + g * LAY_ROWS * G, G, (half *)D->scales + at);
            if (S->offsets)
                lay_groups_x16(S->offsets + g * LAY_ROWS * G, G, (half *)D->offsets + at);
        } else if (S->kind == KIND_Q4_K)
            for (int64_t b = 0; b < nb; b++)
                lay_q4_k_x16(src + b * 144, ld, dst + b * LAY_ROWS * 144);
        else
            for (int64_t b = 0; b < nb; b++)
                lay_q6_k_x16(src + b * 210, ld, dst + b * LAY_ROWS * 212);
    }
    return 0;
}
