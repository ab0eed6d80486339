/* LUT-GEMV and decode of DKM palettized weights on the CPU, read straight from the saved n-bit index stream.
 *
 * The stream is `_packing.pack_indices`'s: index i of the row-major [rows, cols] weight sits at bits
 * [i*bits, (i+1)*bits) of a little-endian bit stream, so every 8 indices are one little-endian word of `bits` bytes
 * and, with cols a multiple of 8, every row starts on a byte. Weight (r, c) is
 *     round(T[g(r)][idx(r, c)] * s[r][c / block])
 * with the row's table T (one per group of rows_per_group rows, padded to 2^bits floats by the caller so that any
 * index is in bounds), the optional block scale s (float32, float16 or bfloat16, as saved) and round() the dtype the
 * torch path hands to F.linear (float32: none, bfloat16 or float16: round to nearest even). That is bit for bit the
 * weight `_dkm.decode(...).to(dtype)` gives; `lut_decode` writes it, `lut_gemv` multiplies it by x without writing it.
 *
 * Two implementations of the same loops: a portable one (any compiler, any CPU) and, on x86-64 CPUs with AVX-512
 * VBMI (chosen at run time), one that turns 64 indices into bytes with one byte permute and one multishift and looks
 * 16 of them up in a register-held table with one permute. Rows are shared among OpenMP threads when built with it.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

enum { SCALE_NONE = 0, SCALE_F32 = 1, SCALE_F16 = 2, SCALE_BF16 = 3 };
enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };
#define MAXM 8 /* tokens multiplied per pass over the weight */
/* Each loop family is compiled once per token count 1..MAXM (the count a constant, the accumulators registers). */
#define EACH_M(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#define BY_M(name) {0, name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8}

/* Bytes of the index stream the SIMD loops ask the cache for ahead of the chunk they read: a weight streamed from
 * memory (every layer of a generating model) otherwise runs at a fraction of the memory's speed. */
#define PREFETCH_AHEAD 2048

typedef struct {
    const uint8_t *packed;
    int64_t rows, cols, rows_per_group, nblocks;
    int bits;
    const void *lut; /* [groups, 1 << bits] in float32, float16 or bfloat16 (lut_dtype: the SCALE_* codes) */
    int lut_dtype;
    const void *scale;
    int scale_dtype;
    int mode; /* OUT_*: the dtype each weight is rounded to */
    int8_t spread[64], shifts[64]; /* byte permute and multishift controls of the AVX-512 index unpacking */
    int8_t wbytes[2][64];          /* bfloat16 loops: the two bytes that hold index 32h + j go to word j ... */
    int16_t wshift[2][32];         /* ... and are shifted right by its bit offset */
} weight_t;

/* Floats per row table: 2^bits, at least 16 (one AVX-512 register), padded with zeros. */
static inline int64_t table_stride(int bits) { return bits <= 4 ? 16 : (int64_t)1 << bits; }

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline uint16_t bf16_round(float w) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u = bits_from_f32(w);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float value_at(const void *p, int dtype, int64_t i);
static inline float scale_at(const weight_t *w, int64_t i) { return value_at(w->scale, w->scale_dtype, i); }

static inline float value_at(const void *p, int dtype, int64_t i) {
    if (dtype == SCALE_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (dtype == SCALE_BF16) return f32_from_bits((uint32_t)h << 16);
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

/* Row r's table as float32, padded with zeros to table_stride(bits) entries (read as saved: no widened copy). */
static inline void row_table(const weight_t *w, int64_t r, float *out) {
    int64_t k = (int64_t)1 << w->bits, first = (r / w->rows_per_group) * k;
    for (int64_t i = 0; i < k; i++) out[i] = value_at(w->lut, w->lut_dtype, first + i);
    for (int64_t i = k; i < table_stride(w->bits); i++) out[i] = 0.0f;
}

static inline float weight_at(const weight_t *w, const float *table, int64_t r, int64_t c, uint32_t idx) {
    float v = table[idx];
    if (w->scale_dtype != SCALE_NONE) v *= scale_at(w, r * w->nblocks + c / (w->cols / w->nblocks));
    if (w->mode == OUT_BF16) return f32_from_bits((uint32_t)bf16_round(v) << 16);
    if (w->mode == OUT_F16) return (float)(_Float16)v;
    return v;
}

static inline float bf16_value(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* Portable: columns [c0, cols) of row r, 8 indices (one word) at a time; x is float32, or bfloat16 (x_bf16). */
static void row_portable(const weight_t *w, int64_t r, int64_t c0, const void *x, int x_bf16, int64_t m, float *acc,
                         void *out) {
    const uint8_t *row = w->packed + r * w->cols * w->bits / 8;
    float table[256];
    row_table(w, r, table);
    const uint64_t mask = (1u << w->bits) - 1;
    for (int64_t c = c0; c < w->cols; c += 8) {
        uint64_t word = 0;
        memcpy(&word, row + c * w->bits / 8, (size_t)w->bits);
        for (int t = 0; t < 8; t++) {
            float v = weight_at(w, table, r, c + t, (uint32_t)((word >> (t * w->bits)) & mask));
            if (out) {
                int64_t o = r * w->cols + c + t;
                if (w->mode == OUT_BF16) ((uint16_t *)out)[o] = bf16_round(v);
                else if (w->mode == OUT_F16) ((_Float16 *)out)[o] = (_Float16)v;
                else ((float *)out)[o] = v;
            } else {
                for (int64_t j = 0; j < m; j++) {
                    int64_t i = j * w->cols + c + t;
                    acc[j] += v * (x_bf16 ? bf16_value(((const uint16_t *)x)[i]) : ((const float *)x)[i]);
                }
            }
        }
    }
}

#ifdef HAVE_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")))

/* Row r's table (at most 16 entries) widened to float32 in one register, zeros past its end. */
static inline AVX512 __m512 table512(const weight_t *w, int64_t r) {
    const int64_t k = (int64_t)1 << w->bits, first = (r / w->rows_per_group) * k;
    const __mmask16 m = (__mmask16)((1u << k) - 1);
    if (w->lut_dtype == SCALE_F32) return _mm512_maskz_loadu_ps(m, (const float *)w->lut + first);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w->lut + first);
    if (w->lut_dtype == SCALE_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* The 64 indices of one chunk as bytes: lane k of 8 gets the chunk's word k, then byte t of the lane is shifted
 * from bit t*bits of it (multishift) and masked. */
static inline AVX512 __m512i chunk_indices(const uint8_t *src, int bits, __m512i spread, __m512i shifts) {
    __m512i raw = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (8 * bits)) - 1), src);
    __m512i fields = _mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(spread, raw));
    return _mm512_and_si512(fields, _mm512_set1_epi8((char)((1 << bits) - 1)));
}

static inline AVX512 __m512 round_vec(__m512 v, int mode) {
    if (mode == OUT_BF16) {
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
    }
    if (mode == OUT_F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}

/* Row r, whole chunks of 64 columns; returns the first column left to the portable loop. M is a constant after
 * inlining, so the accumulators stay in registers. */
static inline AVX512 __attribute__((always_inline)) int64_t row_avx512(const weight_t *w, int64_t r, const float *x,
                                                                      const int M, float *acc, void *out) {
    const int bits = w->bits;
    const int64_t cols64 = w->cols / 64 * 64;
    const uint8_t *row = w->packed + r * w->cols * bits / 8;
    const __m512i spread = _mm512_loadu_si512(w->spread), shifts = _mm512_loadu_si512(w->shifts);
    /* Scaling and rounding commute with the lookup: round(T[i] * s) is entry i of round(T * s), so each block's
     * table is scaled and rounded once, not each weight. */
    const __m512 raw_table = table512(w, r);
    const int64_t block = w->scale_dtype == SCALE_NONE ? 0 : w->cols / w->nblocks;
    const int64_t first_scale = r * w->nblocks;
    __m512 table = round_vec(raw_table, w->mode);
    int64_t next_block = 0, b = -1; /* the column where the next block starts; the current block */
    /* One named accumulator per token: dead ones (j >= M) vanish once M is a constant. */
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t c = 0; c < cols64; c += 64) {
        _mm_prefetch((const char *)(row + c * bits / 8) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m512i idx8 = chunk_indices(row + c * bits / 8, bits, spread, shifts);
        for (int q = 0; q < 4; q++) {
            int64_t col = c + 16 * q;
            if (block && col == next_block) {
                b++;
                next_block += block;
                table = round_vec(_mm512_mul_ps(raw_table, _mm512_set1_ps(scale_at(w, first_scale + b))), w->mode);
            }
            __m128i part = q == 0   ? _mm512_castsi512_si128(idx8)
                           : q == 1 ? _mm512_extracti32x4_epi32(idx8, 1)
                           : q == 2 ? _mm512_extracti32x4_epi32(idx8, 2)
                                    : _mm512_extracti32x4_epi32(idx8, 3);
            __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(part), table);
            if (out) {
                int64_t o = r * w->cols + col;
                if (w->mode == OUT_BF16)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + o),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
                else if (w->mode == OUT_F16)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + o),
                                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                else _mm512_storeu_ps((float *)out + o, v);
            } else {
#define FMA(j) \
    if (M > j) s##j = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + j * w->cols + col), s##j)
                FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5); FMA(6); FMA(7);
#undef FMA
            }
        }
    }
    const __m512 sums[MAXM] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int j = 0; j < M; j++) acc[j] = _mm512_reduce_add_ps(sums[j]);
    return cols64;
}

#define ROWS_AVX512(M)                                                                                                \
    static AVX512 void rows_avx512_##M(const weight_t *w, int64_t r, const float *x, float *acc, void *out) {        \
        int64_t c0 = row_avx512(w, r, x, M, acc, out);                                                                \
        row_portable(w, r, c0, x, 0, M, acc, out);                                                                    \
    }
EACH_M(ROWS_AVX512)
static void (*const rows_avx512[MAXM + 1])(const weight_t *, int64_t, const float *, float *, void *) =
    BY_M(rows_avx512);
#endif

#ifdef HAVE_X86
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16")))

/* bfloat16 inputs times bfloat16-rounded weights (a bfloat16 model): 32 indices become words with one byte permute
 * and one variable shift, one word permute looks all 32 up in a register-held bfloat16 table, and one dot-product
 * instruction multiplies them by 32 inputs (the products are exact; float32 sums, in another order than F.linear's,
 * with the instruction's flush of subnormal numbers to zero). */
static inline AVX512BF16 __attribute__((always_inline)) int64_t row_bf16(const weight_t *w, int64_t r,
                                                                        const uint16_t *x, const int M, float *acc) {
    const int bits = w->bits;
    const int64_t cols64 = w->cols / 64 * 64;
    const uint8_t *row = w->packed + r * w->cols * bits / 8;
    const __m512 raw_table = table512(w, r);
    const int64_t block = w->scale_dtype == SCALE_NONE ? 0 : w->cols / w->nblocks;
    const __m512i bytes0 = _mm512_loadu_si512(w->wbytes[0]), bytes1 = _mm512_loadu_si512(w->wbytes[1]);
    const __m512i shift0 = _mm512_loadu_si512(w->wshift[0]), shift1 = _mm512_loadu_si512(w->wshift[1]);
    const __m512i mask = _mm512_set1_epi16((short)((1 << bits) - 1));
#define WORDS(v) _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)))
    __m512i table = WORDS(round_vec(raw_table, OUT_BF16));
    int64_t next_block = 0, b = -1;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t c = 0; c < cols64; c += 64) {
        _mm_prefetch((const char *)(row + c * bits / 8) + PREFETCH_AHEAD, _MM_HINT_T0);
        __m512i raw = _mm512_maskz_loadu_epi8((__mmask64)((1ull << (8 * bits)) - 1), row + c * bits / 8);
        for (int h = 0; h < 2; h++) {
            int64_t col = c + 32 * h;
            if (block && col == next_block) {
                b++;
                next_block += block;
                __m512 scaled = _mm512_mul_ps(raw_table, _mm512_set1_ps(scale_at(w, r * w->nblocks + b)));
                table = WORDS(round_vec(scaled, OUT_BF16));
            }
            __m512i idx = _mm512_permutexvar_epi8(h ? bytes1 : bytes0, raw);
            idx = _mm512_and_si512(_mm512_srlv_epi16(idx, h ? shift1 : shift0), mask);
            __m512bh v = (__m512bh)_mm512_permutexvar_epi16(idx, table);
#define DOT(j) \
    if (M > j) s##j = _mm512_dpbf16_ps(s##j, v, (__m512bh)_mm512_loadu_si512(x + j * w->cols + col))
            DOT(0); DOT(1); DOT(2); DOT(3); DOT(4); DOT(5); DOT(6); DOT(7);
#undef DOT
        }
    }
#undef WORDS
    const __m512 sums[MAXM] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int j = 0; j < M; j++) acc[j] = _mm512_reduce_add_ps(sums[j]);
    return cols64;
}

#define ROWS_BF16(M)                                                                                                  \
    static AVX512BF16 void rows_bf16_##M(const weight_t *w, int64_t r, const void *x, float *acc) {                  \
        int64_t c0 = row_bf16(w, r, (const uint16_t *)x, M, acc);                                                     \
        row_portable(w, r, c0, x, 1, M, acc, 0);                                                                      \
    }
EACH_M(ROWS_BF16)
static void (*const rows_bf16[MAXM + 1])(const weight_t *, int64_t, const void *, float *) =
    BY_M(rows_bf16);
#endif

#ifdef HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

static inline AVX2 __m256 round_vec8(__m256 v, int mode) {
    if (mode == OUT_BF16) {
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    }
    if (mode == OUT_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}

/* Row r, 8 columns (one index word) at a time: the word (at most 32 bits) is broadcast and shifted per lane; a
 * table of up to 8 entries is one register permute, of 16 two permutes and a blend on the index's bit 3. */
static inline AVX2 __attribute__((always_inline)) int64_t row_avx2(const weight_t *w, int64_t r, const float *x,
                                                                  const int M, float *acc, void *out) {
    const int bits = w->bits;
    const int64_t cols8 = w->cols / 8 * 8;
    const uint8_t *row = w->packed + r * w->cols * bits / 8;
    float t[16];
    row_table(w, r, t);
    const __m256 raw_lo = _mm256_loadu_ps(t), raw_hi = _mm256_loadu_ps(t + 8);
    const __m256i shifts = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits);
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    const int64_t block = w->scale_dtype == SCALE_NONE ? 0 : w->cols / w->nblocks;
    __m256 lo = round_vec8(raw_lo, w->mode), hi = round_vec8(raw_hi, w->mode);
    int64_t next_block = 0, b = -1;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t c = 0; c < cols8; c += 8) {
        if (block && c == next_block) {
            b++;
            next_block += block;
            __m256 sc = _mm256_set1_ps(scale_at(w, r * w->nblocks + b));
            lo = round_vec8(_mm256_mul_ps(raw_lo, sc), w->mode);
            hi = round_vec8(_mm256_mul_ps(raw_hi, sc), w->mode);
        }
        if ((c & 63) == 0) _mm_prefetch((const char *)(row + c * bits / 8) + PREFETCH_AHEAD, _MM_HINT_T0);
        uint32_t word = 0;
        memcpy(&word, row + c * bits / 8, (size_t)bits);
        __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), mask);
        __m256 v = _mm256_permutevar8x32_ps(lo, idx);
        if (bits == 4)
            v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, idx),
                                 _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        if (out) {
            int64_t o = r * w->cols + c;
            if (w->mode == OUT_BF16) {
                __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
                h = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
                _mm_storeu_si128((__m128i *)((uint16_t *)out + o), _mm256_castsi256_si128(h));
            } else if (w->mode == OUT_F16)
                _mm_storeu_si128((__m128i *)((uint16_t *)out + o),
                                 _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            else _mm256_storeu_ps((float *)out + o, v);
        } else {
#define FMA(j) \
    if (M > j) s##j = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + j * w->cols + c), s##j)
            FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5); FMA(6); FMA(7);
#undef FMA
        }
    }
    const __m256 sums[MAXM] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int j = 0; j < M; j++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(sums[j]), _mm256_extractf128_ps(sums[j], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        acc[j] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
    return cols8;
}

#define ROWS_AVX2(M)                                                                                                  \
    static AVX2 void rows_avx2_##M(const weight_t *w, int64_t r, const float *x, float *acc, void *out) {            \
        int64_t c0 = row_avx2(w, r, x, M, acc, out);                                                                  \
        row_portable(w, r, c0, x, 0, M, acc, out);                                                                    \
    }
EACH_M(ROWS_AVX2)
static void (*const rows_avx2[MAXM + 1])(const weight_t *, int64_t, const float *, float *, void *) =
    BY_M(rows_avx2);
#endif

enum { LEVEL_PORTABLE = 0, LEVEL_AVX2 = 1, LEVEL_AVX512 = 2, LEVEL_AVX512BF16 = 3 };
static int max_level = LEVEL_AVX512BF16; /* lut_max_level(n) caps the loops taken (tests compare them) */

void lut_max_level(int level) { max_level = level; }

/* The loops this CPU and this weight take: with bfloat16 inputs (x_bf16), the AVX-512 BF16 loops (block scales
 * multiples of 32 columns); else AVX-512 (an x86-64 CPU with VBMI, block scales multiples of 16 columns), AVX2
 * (with FMA and F16C, block scales multiples of 8), or portable; SIMD only up to 4 bits. */
static int level(const weight_t *w, int x_bf16) {
#ifdef HAVE_X86
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512dq");
        cpu = avx512 && __builtin_cpu_supports("avx512bf16") ? LEVEL_AVX512BF16
              : avx512                                       ? LEVEL_AVX512
              : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? LEVEL_AVX2
                                                                                 : LEVEL_PORTABLE;
    }
    int block = w->scale_dtype == SCALE_NONE ? 0 : (int)(w->cols / w->nblocks);
    int best = cpu < max_level ? cpu : max_level;
    if (w->bits > 4) return LEVEL_PORTABLE;
    if (x_bf16) return best == LEVEL_AVX512BF16 && block % 32 == 0 ? LEVEL_AVX512BF16 : LEVEL_PORTABLE;
    if (best >= LEVEL_AVX512 && block % 16 == 0) return LEVEL_AVX512;
    if (best >= LEVEL_AVX2 && block % 8 == 0) return LEVEL_AVX2;
#else
    (void)w;
    (void)x_bf16;
#endif
    return LEVEL_PORTABLE;
}

static void one_row(const weight_t *w, int lvl, int64_t r, const void *x, int x_bf16, int64_t m, float *y,
                    void *out) {
    float acc[MAXM] = {0};
#ifdef HAVE_X86
    if (lvl == LEVEL_AVX512BF16) rows_bf16[m](w, r, x, acc);
    else if (lvl == LEVEL_AVX512) rows_avx512[out ? 1 : m](w, r, (const float *)x, acc, out);
    else if (lvl == LEVEL_AVX2) rows_avx2[out ? 1 : m](w, r, (const float *)x, acc, out);
    else
#endif
        row_portable(w, r, 0, x, x_bf16, m, acc, out);
    (void)lvl;
    if (!out)
        for (int64_t j = 0; j < m; j++) y[j * w->rows + r] = acc[j];
}

static void run(weight_t *w, const void *x, int x_bf16, int64_t m, float *y, void *out, int threads) {
    int lvl = level(w, x_bf16);
    for (int k = 0; k < 8; k++)
        for (int t = 0; t < 8; t++) {
            w->spread[8 * k + t] = (int8_t)(w->bits * k + (t < w->bits ? t : 0));
            w->shifts[8 * k + t] = (int8_t)(t * w->bits);
        }
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 32; j++) {
            int bit = (32 * h + j) * w->bits;
            w->wbytes[h][2 * j] = (int8_t)(bit / 8);
            w->wbytes[h][2 * j + 1] = (int8_t)((bit / 8 + 1) & 63);
            w->wshift[h][j] = (int16_t)(bit % 8);
        }
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < w->rows; r++) one_row(w, lvl, r, x, x_bf16, m, y, out);
}

#define WEIGHT                                                                                                        \
    {packed, rows, cols, rows_per_group, nblocks, bits, lut, lut_dtype, scale, scale_dtype, mode,                  \
     {0},    {0},  {{0}}, {{0}}}

/* y[m, rows] = x[m, cols] @ W^T for any m tokens: float32 x (x_bf16 = 0) or bfloat16 x (x_bf16 = 1, with mode
 * bfloat16), float32 y. */
void lut_gemv(const uint8_t *packed, int64_t rows, int64_t cols, int bits, const void *lut, int lut_dtype,
              int64_t rows_per_group, const void *scale, int scale_dtype, int64_t nblocks, int mode, const void *x,
              int x_bf16, int64_t m, float *y, int threads) {
    weight_t w = WEIGHT;
    const size_t item = x_bf16 ? 2 : 4;
    for (int64_t j = 0; j < m; j += MAXM) /* the weight is read once per MAXM tokens */
        run(&w, (const char *)x + (size_t)(j * cols) * item, x_bf16, m - j < MAXM ? m - j : MAXM, y + j * rows, 0,
            threads);
}

/* out[rows, cols] = W in float32, bfloat16 or float16 (mode). */
void lut_decode(const uint8_t *packed, int64_t rows, int64_t cols, int bits, const void *lut, int lut_dtype,
                int64_t rows_per_group, const void *scale, int scale_dtype, int64_t nblocks, int mode, void *out,
                int threads) {
    weight_t w = WEIGHT;
    run(&w, 0, 0, 0, 0, out, threads);
}

/* The loops a weight of `bits` bits with blocks of `block` columns (0: no scales) takes on this CPU, for float32
 * inputs or bfloat16 ones (x_bf16): 3 AVX-512 BF16, 2 AVX-512, 1 AVX2, 0 portable. */
int lut_level(int bits, int block, int x_bf16) {
    weight_t w = {0,         1, block ? block : 64, 1, block ? 1 : 0, bits, 0, SCALE_F32, 0,
                  block ? SCALE_F32 : SCALE_NONE, OUT_F32, {0}, {0}, {{0}}, {{0}}};
    return level(&w, x_bf16);
}
