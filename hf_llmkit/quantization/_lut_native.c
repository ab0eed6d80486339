/* LUT-GEMV and decode of DKM palettized weights on the CPU, read straight from the saved n-bit index stream.
 *
 * The stream is `_packing.pack_indices`'s: index i of the row-major [rows, cols] weight sits at bits
 * [i*bits, (i+1)*bits) of a little-endian bit stream, so every 8 indices are one little-endian word of `bits` bytes
 * and, with cols a multiple of 8, every row starts on a byte. Weight (r, c) is
 *     round(T[g(r)][idx(r, c)] * s[r][c / block])
 * with the row's table T (one per group of rows_per_group rows), the optional block scale s (float32, float16 or
 * bfloat16, as saved) and round() the dtype the torch path hands to F.linear (float32: none, bfloat16 or float16:
 * round to nearest even). That is bit for bit the weight `_dkm.decode(...).to(dtype)` gives; `lut_decode` writes it,
 * `lut_decode_rows` writes some of its rows (an embedding's lookup), `lut_gemv` multiplies it by x without writing it.
 *
 * Loops, chosen at run time per CPU and weight (`level`), each a small unit the tests force in turn (`lut_max_level`):
 * - portable C (any compiler, any CPU), 8 indices per word looked up into two 4-lane vectors, one table read per
 *   weight, or one pair-table read per two where a table serves enough weights to pay for its pairs;
 * - AVX2 + FMA (x86-64 since 2013): 64 indices at a time as 8 lanes of 8 fields (one load, a byte shuffle at 3 bits),
 *   one shift and one `vpermps` per 8 weights from a table held in a register (two and a blend at 4 bits), against
 *   inputs rearranged once per call to the lanes' order; 5-8 bit tables (embeddings) are read by `vgatherdps`;
 * - AVX-512 VBMI (float32 inputs) and AVX512-BF16 (bfloat16 inputs and weights): 64 indices with one byte permute
 *   and one multishift, 16 (or 32) lookups per permute; 8-bit tables saved in 16 bits (embeddings, a tied LM head)
 *   held in 8 registers, 32 lookups by four word permutes and two blends;
 * - NEON (`_lut_neon.c`, every AArch64 CPU: Apple silicon, Graviton), up to 4 bits: 16 indices at a time, looked up
 *   by four byte-table lookups (`tbl`) in the table's byte planes, multiplied and added in the portable loop's order,
 *   so its sums are the portable loop's bit for bit (both built with `-ffp-contract=off`: no fused multiply-add).
 * Every input dtype (float32, bfloat16, float16) is widened to float32 once per call for the loops that take float32.
 * Rows are shared among OpenMP threads when built with it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(LUT_NO_NEON)
#include <arm_neon.h>
#define HAVE_NEON 1
#endif

enum { SCALE_NONE = 0, SCALE_F32 = 1, SCALE_F16 = 2, SCALE_BF16 = 3 }; /* also the dtype codes of tables and x */
enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };
enum { LEVEL_PORTABLE = 0, LEVEL_AVX2 = 1, LEVEL_AVX512 = 2, LEVEL_AVX512BF16 = 3, LEVEL_NEON = 4 };
#define MAXM 8 /* tokens multiplied per pass over the weight */
/* Each loop family is compiled once per token count 1..MAXM (the count a constant, the accumulators registers). */
#define EACH_M(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#define BY_M(name) {0, name##_1, name##_2, name##_3, name##_4, name##_5, name##_6, name##_7, name##_8}
/* The AVX2 and NEON loops are compiled for 1, 2, 4 and 8 tokens (half the build time); other counts run padded with
 * zero inputs (batch-1 decoding, the case that matters, is never padded). */
#define EACH_M_AVX2(X) X(1) X(2) X(4) X(8)
#define BY_M_AVX2(name) {0, name##_1, name##_2, 0, name##_4, 0, 0, 0, name##_8}
#define PAD_M(n) ((n) <= 2 ? (n) : (n) <= 4 ? 4 : 8)

/* Bytes of the index stream the SIMD loops ask the cache for ahead of the chunk they read: a weight streamed from
 * memory (every layer of a generating model) otherwise runs at a fraction of the memory's speed. */
#define PREFETCH_AHEAD 2048

typedef struct {
    const uint8_t *packed, *end; /* the index stream and one past its last byte (no loop reads beyond it) */
    int64_t rows, cols, rows_per_group, nblocks, block; /* block: columns per scale (0: no scales) */
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

/* One call's inputs: x as given (x_dtype), widened to float32 (xf), and rearranged for the AVX2 chunks or the AVX-512
 * loop's shifted order (xt). */
typedef struct {
    const void *x;
    int x_dtype;
    int64_t m;
    const float *xf, *xt;
} input_t;

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline uint16_t bf16_round(float w) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u = bits_from_f32(w);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float value_at(const void *p, int dtype, int64_t i) {
    if (dtype == SCALE_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (dtype == SCALE_BF16) return f32_from_bits((uint32_t)h << 16);
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline float scale_at(const weight_t *w, int64_t i) { return value_at(w->scale, w->scale_dtype, i); }

static inline float round_to(float v, int mode) {
    if (mode == OUT_BF16) return f32_from_bits((uint32_t)bf16_round(v) << 16);
    if (mode == OUT_F16) return (float)(_Float16)v;
    return v;
}

static inline void store_to(void *out, int64_t o, float v, int mode) {
    if (mode == OUT_BF16) ((uint16_t *)out)[o] = bf16_round(v);
    else if (mode == OUT_F16) ((_Float16 *)out)[o] = (_Float16)v;
    else ((float *)out)[o] = v;
}

static inline const uint8_t *row_bytes(const weight_t *w, int64_t r) { return w->packed + r * w->cols * w->bits / 8; }

/* Row r's table as float32 (2^bits entries, read as saved: no widened copy is kept). */
static inline void row_table(const weight_t *w, int64_t r, float *out) {
    int64_t k = (int64_t)1 << w->bits, first = (r / w->rows_per_group) * k;
    for (int64_t i = 0; i < k; i++) out[i] = value_at(w->lut, w->lut_dtype, first + i);
}

/* Row r's raw table and, without scales, the same rounded to the mode (with scales: rounded per block or weight). */
static inline void row_tables(const weight_t *w, int64_t r, float *raw, float *base) {
    row_table(w, r, raw);
    if (!w->block)
        for (int64_t i = 0; i < ((int64_t)1 << w->bits); i++) base[i] = round_to(raw[i], w->mode);
}

/* The last words of the stream, read byte by byte (out of line: the loops keep their word in a register). */
static __attribute__((noinline)) uint64_t tail_word(const uint8_t *p, int bits) {
    uint64_t word = 0;
    memcpy(&word, p, (size_t)bits);
    return word;
}

/* The 8 indices at p as one word (`bits` bytes), never reading past the stream's end. */
static inline uint64_t index_word(const weight_t *w, const uint8_t *p, const int bits) {
    uint64_t word;
    if (p + 8 <= w->end) memcpy(&word, p, 8);
    else word = tail_word(p, bits);
    return bits == 8 ? word : word & ((1ull << (8 * bits)) - 1);
}

/* ---- portable ---------------------------------------------------------------------------------------------------- */

/* 4 float32 lanes (GCC / Clang vector extension: SSE on x86-64, NEON on AArch64, scalar code elsewhere); with
 * `-ffp-contract=off` a multiply and an add stay two roundings, as in scalar code. */
typedef float f32x4 __attribute__((vector_size(16)));

static inline f32x4 load4(const float *p) {
    f32x4 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* Entries of the 4 fields from field f of `word` on (a constant shift each after inlining). */
#define LOOKUP4(table, word, f, bits, mask)                                                                           \
    ((f32x4){(table)[((word) >> ((f) * (bits))) & (mask)], (table)[((word) >> (((f) + 1) * (bits))) & (mask)],       \
             (table)[((word) >> (((f) + 2) * (bits))) & (mask)], (table)[((word) >> (((f) + 3) * (bits))) & (mask)]})

/* A pair table of up to 4 bits: entry p (2 * bits bits: field f in its low bits, field f + 1 above) holds the two
 * weights (T[f], T[f + 1]), so two fields take one shift, one mask and one 8-byte load. Built from a table that
 * serves enough weights to pay for its 2^(2 * bits) pairs (a group's, or a long block's); the same values as
 * LOOKUP4's, so the same bits. */
#define PAIRS_MAX 512 /* floats: 256 pairs of a 4-bit table */
typedef uint64_t u64x2 __attribute__((vector_size(16)));

static inline int pairs_pay(int bits, int64_t weights) {
    return bits <= 4 && weights >= ((int64_t)2 << (2 * bits));
}

static inline void build_pairs(const float *table, int bits, float *pairs) {
    const int64_t k = (int64_t)1 << bits;
    for (int64_t p = 0; p < k * k; p++) pairs[2 * p] = table[p & (k - 1)], pairs[2 * p + 1] = table[p >> bits];
}

static inline f32x4 pairs4(const float *pairs, uint64_t a, uint64_t b, const int bits) {
    const uint64_t mask2 = ((uint64_t)1 << (2 * bits)) - 1;
    uint64_t lo, hi;
    memcpy(&lo, pairs + 2 * (a & mask2), 8);
    memcpy(&hi, pairs + 2 * (b & mask2), 8);
    const u64x2 v = {lo, hi};
    return (f32x4)v;
}

/* Weights of fields f..f+3 of `word`: from the pair table where there is one, else the table. */
#define WEIGHTS4(pairs, table, word, f, bits, mask)                                                                   \
    ((pairs) ? pairs4(pairs, (word) >> ((f) * (bits)), (word) >> (((f) + 2) * (bits)), bits)                         \
             : LOOKUP4(table, word, f, bits, mask))

/* Columns [c0, cols) of row r from its raw table (and, without scales, that table rounded to the mode: base): into
 * acc[j] += row . x_j (x float32, natural order), or decoded into out_row. `bits` is a constant after inlining (the
 * shifts are immediates). Eight partial sums per token, as two vectors of 4 lanes: lane t of lo (hi) sums columns
 * 8i + t (8i + 4 + t), one multiply then one add each (the NEON loop sums in this order too, bit for bit). The 8
 * weights of a word are looked up straight into two vectors (no stores to reload). `pairs` (PAIRS_MAX floats, or
 * NULL): without scales, base's pair table (the caller's, where it pays); with scales, room for each block's. */
static inline __attribute__((always_inline)) void span_bits(const weight_t *w, int64_t r, int64_t c0,
                                                            const float *raw, const float *base, const float *x,
                                                            int64_t m, float *acc, void *out_row, float *pairs,
                                                            const int bits) {
    const int64_t k = (int64_t)1 << bits, block = w->block, cols = w->cols;
    const uint64_t mask = (uint64_t)k - 1;
    const uint8_t *row = row_bytes(w, r);
    /* with scales, a table of <= 16 entries is scaled and rounded once per block; larger ones per weight */
    const int per_block = block && k <= 16 && block % 8 == 0;
    float scaled[16];
    const float *table = base;
    if (block && !(per_block && pairs_pay(bits, block))) pairs = 0; /* blocks too short to pay for their pairs */
    f32x4 sums[MAXM][2];
    memset(sums, 0, sizeof(sums));
    int64_t next_block = c0;
    if (m == 1 && !out_row && (!block || per_block)) { /* one token (decoding) */
        f32x4 lo = {0, 0, 0, 0}, hi = lo;
        for (int64_t c = c0; c < cols; c += 8) {
            if (block && c >= next_block) {
                next_block = (c / block + 1) * block;
                const float s = scale_at(w, r * w->nblocks + c / block);
                for (int64_t i = 0; i < k; i++) scaled[i] = round_to(raw[i] * s, w->mode);
                table = scaled;
                if (pairs) build_pairs(scaled, bits, pairs);
            }
            const uint64_t word = index_word(w, row + c * bits / 8, bits);
            lo += WEIGHTS4(pairs, table, word, 0, bits, mask) * load4(x + c);
            hi += WEIGHTS4(pairs, table, word, 4, bits, mask) * load4(x + c + 4);
        }
        acc[0] += ((lo[0] + lo[1]) + (lo[2] + lo[3])) + ((hi[0] + hi[1]) + (hi[2] + hi[3]));
        return;
    }
    for (int64_t c = c0; c < cols; c += 8) {
        const uint64_t word = index_word(w, row + c * bits / 8, bits);
        f32x4 v[2];
        if (block && !per_block) { /* each weight scaled and rounded */
            float each[8];
            for (int t = 0; t < 8; t++)
                each[t] = round_to(raw[(word >> (t * bits)) & mask] * scale_at(w, r * w->nblocks + (c + t) / block),
                                   w->mode);
            v[0] = load4(each), v[1] = load4(each + 4);
        } else {
            if (block && c >= next_block) {
                next_block = (c / block + 1) * block;
                const float s = scale_at(w, r * w->nblocks + c / block);
                for (int64_t i = 0; i < k; i++) scaled[i] = round_to(raw[i] * s, w->mode);
                table = scaled;
                if (pairs) build_pairs(scaled, bits, pairs);
            }
            v[0] = WEIGHTS4(pairs, table, word, 0, bits, mask), v[1] = WEIGHTS4(pairs, table, word, 4, bits, mask);
        }
        if (out_row)
            for (int t = 0; t < 8; t++) store_to(out_row, c + t, v[t / 4][t % 4], w->mode);
        else
            for (int64_t j = 0; j < m; j++) {
                sums[j][0] += v[0] * load4(x + j * cols + c);
                sums[j][1] += v[1] * load4(x + j * cols + c + 4);
            }
    }
    for (int64_t j = 0; j < m && !out_row; j++) {
        float s = 0.0f;
        for (int t = 0; t < 8; t++) s += sums[j][t / 4][t % 4];
        acc[j] += s;
    }
}

#define SPAN_BITS(B)                                                                                                  \
    static void span_##B(const weight_t *w, int64_t r, int64_t c0, const float *raw, const float *base,               \
                         const float *x, int64_t m, float *acc, void *out_row, float *pairs) {                        \
        span_bits(w, r, c0, raw, base, x, m, acc, out_row, pairs, B);                                                 \
    }
SPAN_BITS(1) SPAN_BITS(2) SPAN_BITS(3) SPAN_BITS(4) SPAN_BITS(5) SPAN_BITS(6) SPAN_BITS(7) SPAN_BITS(8)
static void (*const spans[9])(const weight_t *, int64_t, int64_t, const float *, const float *, const float *,
                              int64_t, float *, void *, float *) = {0, span_1, span_2, span_3, span_4,
                                                                    span_5, span_6, span_7, span_8};

static void span_portable(const weight_t *w, int64_t r, int64_t c0, const float *raw, const float *base,
                          const float *x, int64_t m, float *acc, void *out_row) {
    spans[w->bits](w, r, c0, raw, base, x, m, acc, out_row, 0);
}

/* Columns [c0, cols) of row r, its table read here (the tails of the AVX-512 loops). */
static void tail_portable(const weight_t *w, int64_t r, int64_t c0, const float *x, int64_t m, float *acc,
                          void *out_row) {
    float raw[256], base[256];
    if (c0 >= w->cols) return;
    row_tables(w, r, raw, base);
    span_portable(w, r, c0, raw, base, x, m, acc, out_row);
}

static void *out_row_of(const weight_t *w, void *out, int64_t i) {
    return out ? (char *)out + i * w->cols * (w->mode == OUT_F32 ? 4 : 2) : 0;
}

/* Rows [r0, r1): y[j, r] (or the decoded rows), each group's table read once (and, where its rows here have
 * enough weights, and no scales, turned into its pair table once). */
static void rows_portable(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out) {
    float raw[256], base[256], acc[MAXM], pairs[PAIRS_MAX];
    int64_t group = -1;
    int paired = 0;
    for (int64_t r = r0; r < r1; r++) {
        if (r / w->rows_per_group != group) {
            group = r / w->rows_per_group;
            row_tables(w, r, raw, base);
            const int64_t last = (group + 1) * w->rows_per_group < r1 ? (group + 1) * w->rows_per_group : r1;
            paired = !w->block && pairs_pay(w->bits, (last - r) * w->cols);
            if (paired) build_pairs(base, w->bits, pairs);
        }
        memset(acc, 0, sizeof(acc));
        spans[w->bits](w, r, 0, raw, base, in ? in->xf : 0, in ? in->m : 0, acc, out_row_of(w, out, r),
                       paired || w->block ? pairs : 0);
        for (int64_t j = 0; in && j < in->m; j++) y[j * w->rows + r] = acc[j];
    }
}

/* ---- the SIMD loops (`_lut_avx2.c`, `_lut_avx512.c`, `_lut_neon.c`: compiled after this file, as one unit) ------ */
#ifdef HAVE_X86
static void rows_avx2(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out);
static void rows_avx512(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out);
static void rows_avx512bf16(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y);
#endif
#ifdef HAVE_NEON
static void rows_neon(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out);
#endif

/* ---- dispatch ---------------------------------------------------------------------------------------------------- */

/* lut_max_level(n) caps the loops taken (tests and benchmarks compare them): every level up to n in LEVEL_* order
 * (the x86-64 levels sit below NEON, so capping an AArch64 CPU at any of them takes its portable loop) */
static int max_level = LEVEL_NEON;

void lut_max_level(int level) { max_level = level; }

static int cpu_level(void) {
#ifdef HAVE_X86
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512dq") &&
                     __builtin_cpu_supports("avx512vl");
        int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        cpu = avx512 && avx2 && __builtin_cpu_supports("avx512bf16") ? LEVEL_AVX512BF16
              : avx512 && avx2                                      ? LEVEL_AVX512
              : avx2                                                ? LEVEL_AVX2
                                                                    : LEVEL_PORTABLE;
    }
    return cpu;
#elif defined(HAVE_NEON)
    return LEVEL_NEON;
#else
    return LEVEL_PORTABLE;
#endif
}

/* Whether this CPU can take the loops of `lvl` (portable: every CPU). */
int lut_has_level(int lvl) {
    if (lvl == LEVEL_PORTABLE) return 1;
#ifdef HAVE_NEON
    return lvl == LEVEL_NEON;
#else
    return lvl != LEVEL_NEON && lvl <= cpu_level();
#endif
}

/* The loops this CPU takes for this weight and x dtype (SCALE_* codes; 0: a decode): AVX512-BF16 for bfloat16 x
 * and weights up to 4 bits (block scales multiples of 32 columns); AVX-512 up to 4 bits (blocks multiples of 16)
 * and at 8 bits with 16-bit tables (blocks multiples of 32);
 * AVX2 up to 8 bits (blocks multiples of 8); NEON up to 4 bits (blocks multiples of 8); else portable. */
static int level(const weight_t *w, int x_dtype) {
    const int64_t block = w->block;
    const int best = cpu_level() < max_level ? cpu_level() : max_level;
#ifdef HAVE_NEON
    return best == LEVEL_NEON && w->bits <= 4 && block % 8 == 0 ? LEVEL_NEON : LEVEL_PORTABLE;
#endif
    if (x_dtype == SCALE_BF16 && w->mode == OUT_BF16 && best == LEVEL_AVX512BF16 && w->bits <= 4 && block % 32 == 0)
        return LEVEL_AVX512BF16;
    if (best >= LEVEL_AVX512 && w->bits <= 4 && block % 16 == 0) return LEVEL_AVX512;
    if (best >= LEVEL_AVX512 && w->bits == 8 && w->lut_dtype != SCALE_F32 && block % 32 == 0) return LEVEL_AVX512;
    if (best >= LEVEL_AVX2 && block % 8 == 0) return LEVEL_AVX2;
    return LEVEL_PORTABLE;
}

static void rows_at(const weight_t *w, int lvl, int64_t r0, int64_t r1, const input_t *in, float *y, void *out) {
#ifdef HAVE_X86
    if (lvl == LEVEL_AVX512BF16) rows_avx512bf16(w, r0, r1, in, y);
    else if (lvl == LEVEL_AVX512) rows_avx512(w, r0, r1, in, y, out);
    else if (lvl == LEVEL_AVX2) rows_avx2(w, r0, r1, in, y, out);
    else
#endif
#ifdef HAVE_NEON
    if (lvl == LEVEL_NEON) rows_neon(w, r0, r1, in, y, out);
    else
#endif
        rows_portable(w, r0, r1, in, y, out);
    (void)lvl;
}

/* Rows shared evenly among `threads` OpenMP threads (each keeps its group's table between rows). */
static void run(const weight_t *w, int lvl, const input_t *in, float *y, void *out, int threads) {
    if (threads <= 1) {
        rows_at(w, lvl, 0, w->rows, in, y, out);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t t = 0, n = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        n = omp_get_num_threads();
#endif
        rows_at(w, lvl, w->rows * t / n, w->rows * (t + 1) / n, in, y, out);
    }
}

/* A weight as the caller hands it over, once per layer (every field 8 bytes wide). */
typedef struct {
    const uint8_t *packed;
    int64_t rows, cols, bits;
    const void *lut;
    int64_t lut_dtype, rows_per_group;
    const void *scale; /* NULL: no block scales */
    int64_t scale_dtype, nblocks;
} weight_args;

static weight_t make_weight(const weight_args *a, int mode) {
    const int bits = (int)a->bits;
    weight_t w;
    memset(&w, 0, sizeof(w));
    w.packed = a->packed;
    w.end = a->packed ? a->packed + (a->rows * a->cols * bits + 7) / 8 : 0;
    w.rows = a->rows, w.cols = a->cols, w.rows_per_group = a->rows_per_group, w.bits = bits;
    w.lut = a->lut, w.lut_dtype = (int)a->lut_dtype, w.scale = a->scale;
    w.scale_dtype = a->scale ? (int)a->scale_dtype : SCALE_NONE;
    w.nblocks = a->scale ? a->nblocks : 0;
    w.block = a->scale ? a->cols / a->nblocks : 0;
    w.mode = mode;
    for (int k = 0; k < 8; k++)
        for (int t = 0; t < 8; t++) {
            w.spread[8 * k + t] = (int8_t)(bits * k + (t < bits ? t : 0));
            w.shifts[8 * k + t] = (int8_t)(t * bits);
        }
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 32; j++) {
            int bit = (32 * h + j) * bits;
            w.wbytes[h][2 * j] = (int8_t)(bit / 8);
            w.wbytes[h][2 * j + 1] = (int8_t)((bit / 8 + 1) & 63);
            w.wshift[h][j] = (int16_t)(bit % 8);
        }
    return w;
}

/* Whether the AVX-512 float32 loop reads x in its shifted order: up to 4 bits, blocks of whole 64-column chunks. */
static int shifted_order(const weight_t *w, int lvl) {
    return lvl == LEVEL_AVX512 && w->bits <= 4 && w->block % 64 == 0 && w->cols >= 64;
}

/* Rows [0, m) of x [m, cols] with each chunk of 64 columns put in the order of `steps` steps of 64 / steps lanes:
 * column steps * l + t at (64 / steps) * t + l; the columns after the last chunk as they are. Returns dst. */
static const float *interleaved(const float *x, float *dst, int64_t m, int64_t cols, const int steps) {
    const int64_t cols64 = cols / 64 * 64, lanes = 64 / steps;
    for (int64_t j = 0; j < m; j++) {
        const float *src = x + j * cols;
        float *out = dst + j * cols;
        for (int64_t c = 0; c < cols64; c += 64)
            for (int t = 0; t < steps; t++)
                for (int64_t l = 0; l < lanes; l++) out[c + lanes * t + l] = src[c + steps * l + t];
        memcpy(out + cols64, src + cols64, (size_t)(cols - cols64) * 4);
    }
    return dst;
}

/* x [m, cols] widened to float32 (xf; rows m..padded zero), for the AVX-512 loop put in its shifted order (xt), or
 * for the AVX2 chunk loops, each chunk of 64 columns
 * rearranged so that the 8 weights one step of a chunk yields, lane l holding column 8l + t at step t, meet their
 * inputs (xt). */
static void prepare_input(const weight_t *w, int lvl, const void *x, int x_dtype, int64_t m, int64_t padded,
                          float *buffer, input_t *in) {
    const int64_t cols = w->cols, n = m * cols;
    in->x = x, in->x_dtype = x_dtype, in->m = padded, in->xf = (const float *)x, in->xt = 0;
    if (x_dtype != SCALE_F32 || padded != m) {
        float *xf = buffer;
        for (int64_t i = 0; i < n; i++) xf[i] = value_at(x, x_dtype, i);
        memset(xf + n, 0, (size_t)((padded - m) * cols) * sizeof(float));
        in->xf = xf;
    }
    /* the AVX-512 loop's shifted order (column 4l + t of a chunk at 16t + l) or the AVX2 lanes' (8l + t at 8t + l) */
    if (shifted_order(w, lvl)) in->xt = interleaved(in->xf, buffer + padded * cols, padded, cols, 4);
    else if (lvl == LEVEL_AVX2 && w->bits <= 4) in->xt = interleaved(in->xf, buffer + padded * cols, padded, cols, 8);
}

/* y[m, rows] = x[m, cols] @ W^T for any m tokens, each weight rounded to `mode` (OUT_*) first; x float32, bfloat16
 * or float16 (x_dtype: SCALE_*), y float32 or rounded to nearest even into bfloat16 or float16 (y_dtype: OUT_*).
 * Returns 0, or -1 where the scratch for the widened inputs could not be allocated. */
int lut_gemv(const weight_args *a, int mode, const void *x, int x_dtype, int64_t m, void *y, int y_dtype,
             int threads) {
    const weight_t w = make_weight(a, mode);
    const int64_t cols = w.cols, rows = w.rows, most = PAD_M(m < MAXM ? m : MAXM);
    const int lvl = level(&w, x_dtype);
    const size_t item = x_dtype == SCALE_F32 ? 4 : 2;
    /* scratch: inputs widened, rearranged, and float32 sums; on the stack for a token's worth (a large allocation
     * is a fresh mapping per call, whose page faults cost as much as a small layer's product) */
    const size_t floats = (size_t)(most * (2 * cols + rows)), on_stack = 16384;
    float stack[16384];
    float *buffer = floats <= on_stack ? stack : malloc(floats * sizeof(float));
    if (!buffer) return -1;
    float *sums = buffer + 2 * most * cols;
    for (int64_t j = 0; j < m; j += MAXM) { /* the weight is read once per MAXM tokens */
        const int64_t n = m - j < MAXM ? m - j : MAXM;
        const int64_t padded = lvl == LEVEL_AVX2 || lvl == LEVEL_NEON ? PAD_M(n) : n;
        input_t in;
        prepare_input(&w, lvl, (const char *)x + (size_t)(j * cols) * item, x_dtype, n, padded, buffer, &in);
        const int direct = y_dtype == OUT_F32 && padded == n;
        run(&w, lvl, &in, direct ? (float *)y + j * rows : sums, 0, threads);
        for (int64_t i = 0; !direct && i < n * rows; i++) store_to(y, j * rows + i, sums[i], y_dtype);
    }
    if (buffer != stack) free(buffer);
    return 0;
}

/* out[rows, cols] = W in float32, bfloat16 or float16 (mode). */
void lut_decode(const weight_args *a, int mode, void *out, int threads) {
    const weight_t w = make_weight(a, mode);
    run(&w, level(&w, 0), 0, 0, out, threads);
}

/* out[n, cols] = rows ids[0..n) of W (an embedding's lookup; ids checked by the caller), in the mode's dtype. */
void lut_decode_rows(const weight_args *a, int mode, const int64_t *ids, int64_t n, void *out) {
    const weight_t w = make_weight(a, mode);
    float raw[256], base[256];
    for (int64_t i = 0; i < n; i++) {
        row_tables(&w, ids[i], raw, base);
        span_portable(&w, ids[i], 0, raw, base, 0, 0, 0, out_row_of(&w, out, i));
    }
}

/* The loops a weight of `bits` bits with blocks of `block` columns (0: no scales) and tables saved as lut_dtype
 * (SCALE_*) takes on this CPU for inputs of x_dtype (bfloat16 inputs meet bfloat16 weights): 4 NEON, 3 AVX-512 BF16,
 * 2 AVX-512, 1 AVX2, 0 portable. */
int lut_level(int bits, int block, int x_dtype, int lut_dtype) {
    static const float one = 1.0f;
    const weight_args a = {0, 1, block ? block : 64, bits, 0, lut_dtype, 1, block ? &one : 0, SCALE_F32, 1};
    const weight_t w = make_weight(&a, x_dtype == SCALE_BF16 ? OUT_BF16 : OUT_F32);
    return level(&w, x_dtype);
}
