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

typedef struct {
    const uint8_t *packed;
    int64_t rows, cols, rows_per_group, nblocks;
    int bits;
    const float *lut; /* [groups, 1 << bits] */
    const void *scale;
    int scale_dtype;
    int mode; /* OUT_*: the dtype each weight is rounded to */
    int8_t spread[64], shifts[64]; /* byte permute and multishift controls of the AVX-512 index unpacking */
} weight_t;

/* Floats per table: 2^bits, at least 16 (one AVX-512 register); the caller pads each table to this. */
static inline int64_t table_stride(int bits) { return bits <= 4 ? 16 : (int64_t)1 << bits; }

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline uint16_t bf16_round(float w) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u = bits_from_f32(w);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float scale_at(const weight_t *w, int64_t i) {
    if (w->scale_dtype == SCALE_F32) return ((const float *)w->scale)[i];
    uint16_t h = ((const uint16_t *)w->scale)[i];
    if (w->scale_dtype == SCALE_BF16) return f32_from_bits((uint32_t)h << 16);
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline float weight_at(const weight_t *w, const float *table, int64_t r, int64_t c, uint32_t idx) {
    float v = table[idx];
    if (w->scale_dtype != SCALE_NONE) v *= scale_at(w, r * w->nblocks + c / (w->cols / w->nblocks));
    if (w->mode == OUT_BF16) return f32_from_bits((uint32_t)bf16_round(v) << 16);
    if (w->mode == OUT_F16) return (float)(_Float16)v;
    return v;
}

/* Portable: columns [c0, cols) of row r, 8 indices (one word) at a time. */
static void row_portable(const weight_t *w, int64_t r, int64_t c0, const float *x, int64_t m, float *acc,
                         void *out) {
    const uint8_t *row = w->packed + r * w->cols * w->bits / 8;
    const float *table = w->lut + (r / w->rows_per_group) * table_stride(w->bits);
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
                for (int64_t j = 0; j < m; j++) acc[j] += v * x[j * w->cols + c + t];
            }
        }
    }
}

#ifdef HAVE_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")))

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
    const __m512 raw_table = _mm512_loadu_ps(w->lut + (r / w->rows_per_group) * 16); /* bits <= 4: 16 floats */
    const int64_t block = w->scale_dtype == SCALE_NONE ? 0 : w->cols / w->nblocks;
    const int64_t first_scale = r * w->nblocks;
    __m512 table = round_vec(raw_table, w->mode);
    int64_t next_block = 0, b = -1; /* the column where the next block starts; the current block */
    /* One named accumulator per token: dead ones (j >= M) vanish once M is a constant. */
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t c = 0; c < cols64; c += 64) {
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
        row_portable(w, r, c0, x, M, acc, out);                                                                       \
    }
ROWS_AVX512(1)
ROWS_AVX512(2)
ROWS_AVX512(3)
ROWS_AVX512(4)
ROWS_AVX512(5)
ROWS_AVX512(6)
ROWS_AVX512(7)
ROWS_AVX512(8)
static void (*const rows_avx512[MAXM + 1])(const weight_t *, int64_t, const float *, float *, void *) = {
    0, rows_avx512_1, rows_avx512_2, rows_avx512_3, rows_avx512_4,
    rows_avx512_5, rows_avx512_6, rows_avx512_7, rows_avx512_8};
#endif

static int portable_only = 0; /* lut_portable_only(1): every weight takes the portable loops (tests compare the two) */

void lut_portable_only(int on) { portable_only = on; }

/* 1 where this CPU and this weight take the AVX-512 loops (an x86-64 CPU with VBMI, at most 4 bits, block scales
 * whole multiples of 16 columns). */
static int use_avx512(const weight_t *w) {
#ifdef HAVE_X86
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512dq");
    }
    return cpu && !portable_only && w->bits <= 4 && (w->scale_dtype == SCALE_NONE || (w->cols / w->nblocks) % 16 == 0);
#else
    (void)w;
    return 0;
#endif
}

static void one_row(const weight_t *w, int fast, int64_t r, const float *x, int64_t m, float *y, void *out) {
    float acc[MAXM] = {0};
#ifdef HAVE_X86
    if (fast) {
        rows_avx512[out ? 1 : m](w, r, x, acc, out);
    } else
#endif
        row_portable(w, r, 0, x, m, acc, out);
    (void)fast;
    if (!out)
        for (int64_t j = 0; j < m; j++) y[j * w->rows + r] = acc[j];
}

static void run(weight_t *w, const float *x, int64_t m, float *y, void *out, int threads) {
    int fast = use_avx512(w);
    for (int k = 0; k < 8; k++)
        for (int t = 0; t < 8; t++) {
            w->spread[8 * k + t] = (int8_t)(w->bits * k + (t < w->bits ? t : 0));
            w->shifts[8 * k + t] = (int8_t)(t * w->bits);
        }
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < w->rows; r++) one_row(w, fast, r, x, m, y, out);
}

/* y[m, rows] = x[m, cols] @ W^T for m <= 8 tokens (float32 x and y). */
void lut_gemv(const uint8_t *packed, int64_t rows, int64_t cols, int bits, const float *lut, int64_t rows_per_group,
              const void *scale, int scale_dtype, int64_t nblocks, int mode, const float *x, int64_t m, float *y,
              int threads) {
    weight_t w = {packed, rows, cols, rows_per_group, nblocks, bits, lut, scale, scale_dtype, mode, {0}, {0}};
    run(&w, x, m, y, 0, threads);
}

/* out[rows, cols] = W in float32, bfloat16 or float16 (mode). */
void lut_decode(const uint8_t *packed, int64_t rows, int64_t cols, int bits, const float *lut, int64_t rows_per_group,
                const void *scale, int scale_dtype, int64_t nblocks, int mode, void *out, int threads) {
    weight_t w = {packed, rows, cols, rows_per_group, nblocks, bits, lut, scale, scale_dtype, mode, {0}, {0}};
    run(&w, 0, 0, 0, out, threads);
}

/* 1 when the AVX-512 loops serve a weight of `bits` bits on this CPU (reported in the log line). */
int lut_simd(int bits) {
    weight_t w = {0, 1, 64, 1, 0, bits, 0, 0, SCALE_NONE, OUT_F32, {0}, {0}};
    return use_avx512(&w);
}
