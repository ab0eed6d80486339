/* The AVX2 loops of the DKM CPU kernel (x86-64 with AVX2, FMA and F16C: most CPUs since 2013, AMD EPYC / Ryzen
 * without AVX-512 among them). Compiled after `_lut_native.c`, as one translation unit with it.
 *
 * Up to 4 bits, a row is read 64 indices (8 * bits bytes) at a time as 8 dword lanes of 8 fields, lane l holding
 * indices 8l..8l+7: one zero-extending load at 1-2 bits, one load at 4 bits, at 3 bits two overlapping 16-byte loads
 * and one byte shuffle that moves each 3-byte group into its lane. Step t of the chunk shifts the lanes right by
 * t * bits and one `vpermps` looks the 8 fields up in a table of 8 floats held in a register (it reads the low 3 bits
 * of each lane: tables of 2 or 4 entries are repeated to 8, so the bits of the next field never matter; 16 entries
 * are two permutes and a blend on the field's bit 3). The 8 weights of step t are columns 8l + t: the inputs were
 * rearranged to that order once per call (`prepare_input`), so each step is one FMA per token. Blocks of scales
 * that split a chunk, and the columns after the last whole chunk, take 8 indices at a time from one broadcast word.
 * Tables of 5-8 bits (embeddings, LM heads) are read one weight at a time into the lanes.
 */
#ifdef HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE_AVX2 static inline AVX2 __attribute__((always_inline))

INLINE_AVX2 __m256 round8(__m256 v, int mode) {
    if (mode == OUT_BF16) {
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    }
    if (mode == OUT_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return v;
}

/* Entries 0-7 of a table in a register; a table of fewer entries repeated to 8. */
INLINE_AVX2 __m256 table_lo(const float *raw, int bits) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = raw[bits >= 3 ? i : i & ((1 << bits) - 1)];
    return _mm256_loadu_ps(t);
}

/* Entries i..i+7 of the table stream as float32 (float32, float16 or bfloat16 as saved). */
INLINE_AVX2 __m256 load8(const void *lut, int dtype, int64_t i) {
    if (dtype == SCALE_F32) return _mm256_loadu_ps((const float *)lut + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)lut + i));
    if (dtype == SCALE_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Row r's table in registers: entries 0-7 (lo; a table of 2 or 4 repeated to 8) and 8-15 (hi, 4 bits), with vector
 * loads from 3 bits up (tables per row, `group_size=1`, are read for every row). */
INLINE_AVX2 void table_regs(const weight_t *w, int64_t r, const int bits, __m256 *lo, __m256 *hi) {
    const int64_t first = (r / w->rows_per_group) << bits;
    if (bits >= 3) {
        *lo = load8(w->lut, w->lut_dtype, first);
        *hi = bits == 4 ? load8(w->lut, w->lut_dtype, first + 8) : *lo;
        return;
    }
    float raw[16];
    row_table(w, r, raw);
    *lo = table_lo(raw, bits);
    *hi = *lo;
}

/* 8 weights: the field in the low bits of each lane looked up (bits above it are ignored). */
INLINE_AVX2 __m256 lookup8(__m256i idx, __m256 lo, __m256 hi, const int bits) {
    __m256 v = _mm256_permutevar8x32_ps(lo, idx);
    if (bits == 4)
        v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
    return v;
}

/* The 64 indices at p as 8 lanes of 8 fields (lane l: indices 8l..8l+7, from bit 0 up). */
INLINE_AVX2 __m256i chunk_lanes(const weight_t *w, const uint8_t *p, const int bits) {
    if (bits == 1) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    if (bits == 2) return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    if (bits == 4) return _mm256_loadu_si256((const __m256i *)p);
    /* 3 bits: bytes 0-15 and 12-27 (the stream's last chunk is copied, so nothing past its end is read); lane l
     * takes bytes 3l..3l+2, which is bytes 3(l - 4).. of the second load for the upper four lanes */
    const __m128i lo = _mm_loadu_si128((const __m128i *)p);
    __m128i hi;
    if (p + 28 <= w->end) hi = _mm_loadu_si128((const __m128i *)(p + 12));
    else {
        uint8_t tail[16] = {0};
        memcpy(tail, p + 12, 12);
        hi = _mm_loadu_si128((const __m128i *)tail);
    }
    const __m256i groups = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,  /* */
                                            0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    return _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), groups);
}

/* The word of 8 indices at p (bits <= 4: at most 4 bytes), never reading past the stream's end. */
INLINE_AVX2 uint32_t word32(const weight_t *w, const uint8_t *p) {
    uint32_t word = 0;
    if (p + 4 <= w->end) memcpy(&word, p, 4);
    else memcpy(&word, p, (size_t)w->bits);
    return word;
}

INLINE_AVX2 float hsum8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* Accumulators: K sets of M tokens (K * M <= 8), step t adding into set t % K, so that at least four independent
 * FMA chains are in flight whatever M is (one chain would wait out each FMA's latency). Constant indices after
 * inlining: the array lives in registers. */
#define SETS(M) ((M) >= 4 ? 1 : (M) >= 2 ? 2 : 4)
#define SUMS                                                                                                          \
    __m256 u[8];                                                                                                      \
    for (int i = 0; i < 8; i++) u[i] = _mm256_setzero_ps()
#define FMA8(set, v, xp, stride)                                                                                      \
    do {                                                                                                              \
        for (int j = 0; j < M; j++)                                                                                   \
            u[(set) * M + j] = _mm256_fmadd_ps(v, _mm256_loadu_ps((xp) + j * (stride)), u[(set) * M + j]);            \
    } while (0)
#define STORE_SUMS(y, rows, r)                                                                                        \
    do {                                                                                                              \
        for (int j = 0; j < M; j++) {                                                                                 \
            __m256 total = u[j];                                                                                      \
            for (int k = 1; k < SETS(M); k++) total = _mm256_add_ps(total, u[k * M + j]);                             \
            (y)[j * (rows) + (r)] = hsum8(total);                                                                     \
        }                                                                                                             \
    } while (0)

/* Rows [r0, r1) of a table of up to 16 entries, M tokens: y[j, r] = row r . x_j. */
INLINE_AVX2 void rows_lut(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, const int bits,
                          const int M) {
    const int64_t cols = w->cols, block = w->block;
    const int64_t chunked = block % 64 == 0 ? cols / 64 * 64 : 0; /* the columns the chunk loop takes */
    const __m256i shifts = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits);
    __m256 raw_lo = _mm256_setzero_ps(), raw_hi = raw_lo, base_lo = raw_lo, base_hi = raw_lo;
    int64_t group = -1;
    for (int64_t r = r0; r < r1; r++) {
        if (r / w->rows_per_group != group) { /* each group's table is read and rounded once */
            group = r / w->rows_per_group;
            table_regs(w, r, bits, &raw_lo, &raw_hi);
            base_lo = round8(raw_lo, w->mode);
            base_hi = round8(raw_hi, w->mode);
        }
        __m256 lo = base_lo, hi = base_hi;
        const uint8_t *row = row_bytes(w, r);
        int64_t next_block = 0, b = r * w->nblocks - 1;
        SUMS;
        /* Scaling and rounding commute with the lookup: round(T[i] * s) is entry i of round(T * s), so each block's
         * table is scaled and rounded once, not each weight. */
#define NEXT_BLOCK(c)                                                                                                 \
    if (block && (c) == next_block) {                                                                                 \
        next_block += block;                                                                                          \
        const __m256 sc = _mm256_set1_ps(scale_at(w, ++b));                                                           \
        lo = round8(_mm256_mul_ps(raw_lo, sc), w->mode);                                                              \
        hi = round8(_mm256_mul_ps(raw_hi, sc), w->mode);                                                              \
    }
        for (int64_t c = 0; c < chunked; c += 64) {
            NEXT_BLOCK(c)
            const uint8_t *p = row + c * bits / 8;
            _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T0);
            const __m256i lanes = chunk_lanes(w, p, bits);
            const float *xc = in->xt + c;
#define STEP(t)                                                                                                       \
    {                                                                                                                 \
        const __m256 v = lookup8(t ? _mm256_srli_epi32(lanes, (t) * bits) : lanes, lo, hi, bits);                     \
        FMA8((t) % SETS(M), v, xc + 8 * (t), cols);                                                                                  \
    }
            STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#undef STEP
        }
        for (int64_t c = chunked; c < cols; c += 8) {
            NEXT_BLOCK(c)
            const __m256i word = _mm256_set1_epi32((int)word32(w, row + c * bits / 8));
            const __m256 v = lookup8(_mm256_srlv_epi32(word, shifts), lo, hi, bits);
            FMA8((c / 8) % SETS(M), v, in->xf + c, cols);
        }
#undef NEXT_BLOCK
        STORE_SUMS(y, w->rows, r);
    }
}

/* 8 weights of a 5-8 bit word looked up one by one (each load inserted into its lane: on the CPUs measured this is
 * about twice as fast as `vgatherdps`); `bits` a constant at 8 bits. */
INLINE_AVX2 __m256 lookup_wide(const float *table, uint64_t word, const int bits) {
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    return _mm256_setr_ps(table[word & mask], table[(word >> bits) & mask], table[(word >> (2 * bits)) & mask],
                          table[(word >> (3 * bits)) & mask], table[(word >> (4 * bits)) & mask],
                          table[(word >> (5 * bits)) & mask], table[(word >> (6 * bits)) & mask],
                          table[(word >> (7 * bits)) & mask]);
}

/* Rows [r0, r1) of a table of 32-256 entries, M tokens; with scales each weight is scaled and rounded after its
 * lookup (as many operations as scaling a 256-entry table once per block of 8+ columns would take). */
INLINE_AVX2 void rows_wide(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, const int M,
                           const int bits) {
    const int64_t cols = w->cols, block = w->block;
    float raw[256], base[256];
    int64_t group = -1;
    for (int64_t r = r0; r < r1; r++) {
        if (r / w->rows_per_group != group) {
            group = r / w->rows_per_group;
            row_tables(w, r, raw, base);
        }
        const float *table = block ? raw : base;
        const uint8_t *row = row_bytes(w, r);
        int64_t next_block = 0, b = r * w->nblocks - 1;
        __m256 sc = _mm256_setzero_ps();
        SUMS;
        for (int64_t c = 0; c < cols; c += 8) {
            const uint8_t *p = row + c * bits / 8;
            if ((c & 63) == 0) _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T0);
            __m256 v = lookup_wide(table, index_word(w, p, bits), bits);
            if (block) {
                if (c == next_block) {
                    next_block += block;
                    sc = _mm256_set1_ps(scale_at(w, ++b));
                }
                v = round8(_mm256_mul_ps(v, sc), w->mode);
            }
            FMA8((c / 8) % SETS(M), v, in->xf + c, cols);
        }
        STORE_SUMS(y, w->rows, r);
    }
}

/* Rows [r0, r1) decoded into out (float32, bfloat16 or float16), 8 weights at a time. */
static AVX2 void decode_avx2(const weight_t *w, int64_t r0, int64_t r1, void *out) {
    const int bits = w->bits;
    const int64_t cols = w->cols, block = w->block;
    const __m256i shifts = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits);
    float raw[256], base[256];
    for (int64_t r = r0; r < r1; r++) {
        row_tables(w, r, raw, base);
        const uint8_t *row = row_bytes(w, r);
        const __m256 raw_lo = table_lo(raw, bits < 4 ? bits : 4), raw_hi = _mm256_loadu_ps(raw + 8);
        __m256 lo = round8(raw_lo, w->mode), hi = round8(raw_hi, w->mode), sc = _mm256_set1_ps(1.0f);
        int64_t next_block = 0, b = r * w->nblocks - 1;
        char *dst = out_row_of(w, out, r);
        for (int64_t c = 0; c < cols; c += 8) {
            const uint8_t *p = row + c * bits / 8;
            if (block && c == next_block) {
                next_block += block;
                sc = _mm256_set1_ps(scale_at(w, ++b));
                lo = round8(_mm256_mul_ps(raw_lo, sc), w->mode);
                hi = round8(_mm256_mul_ps(raw_hi, sc), w->mode);
            }
            __m256 v;
            if (bits <= 4) {
                const __m256i word = _mm256_set1_epi32((int)word32(w, p));
                v = lookup8(_mm256_srlv_epi32(word, shifts), lo, hi, bits == 4 ? 4 : 3);
            } else {
                v = lookup_wide(block ? raw : base, index_word(w, p, bits), bits);
                if (block) v = round8(_mm256_mul_ps(v, sc), w->mode);
            }
            if (w->mode == OUT_BF16) { /* v holds bfloat16 values: their upper halves */
                __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
                h = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
                _mm_storeu_si128((__m128i *)(dst + 2 * c), _mm256_castsi256_si128(h));
            } else if (w->mode == OUT_F16)
                _mm_storeu_si128((__m128i *)(dst + 2 * c),
                                 _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            else _mm256_storeu_ps((float *)(dst + 4 * c), v);
        }
    }
}

typedef void (*rows_fn)(const weight_t *, int64_t, int64_t, const input_t *, float *);
#define LUT_ROWS(B, M)                                                                                                \
    static AVX2 void lut##B##_##M(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y) {          \
        rows_lut(w, r0, r1, in, y, B, M);                                                                             \
    }
#define AVX2_ROWS(M)                                                                                                  \
    LUT_ROWS(1, M) LUT_ROWS(2, M) LUT_ROWS(3, M) LUT_ROWS(4, M)                                                       \
    static AVX2 void bytes_##M(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y) {              \
        rows_wide(w, r0, r1, in, y, M, 8);                                                                            \
    }                                                                                                                 \
    static AVX2 void wide_##M(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y) {               \
        rows_wide(w, r0, r1, in, y, M, w->bits);                                                                      \
    }
EACH_M_AVX2(AVX2_ROWS)
static const rows_fn lut_rows[5][MAXM + 1] = {{0}, BY_M_AVX2(lut1), BY_M_AVX2(lut2), BY_M_AVX2(lut3), BY_M_AVX2(lut4)};
static const rows_fn byte_rows[MAXM + 1] = BY_M_AVX2(bytes), wide_rows[MAXM + 1] = BY_M_AVX2(wide);

static void rows_avx2(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out) {
    if (out) decode_avx2(w, r0, r1, out);
    else if (w->bits <= 4) lut_rows[w->bits][in->m](w, r0, r1, in, y);
    else if (w->bits == 8) byte_rows[in->m](w, r0, r1, in, y);
    else wide_rows[in->m](w, r0, r1, in, y);
}
#endif
