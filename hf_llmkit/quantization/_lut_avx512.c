/* The AVX-512 loops of the DKM CPU kernel (x86-64 with AVX-512 VBMI, and AVX512-BF16 for bfloat16 models). Compiled
 * after `_lut_native.c`, as one translation unit with it. These loops cannot run on a CPU without AVX-512: the tests
 * take them where the CPU has it, and cap to the AVX2 and portable loops everywhere.
 */
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
                int64_t o = col;
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
                if (M == 1 && (q & 1)) /* one token: two chains of sums, not one waiting on each add */
                    s1 = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + col), s1);
                else {
                    FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5); FMA(6); FMA(7);
                }
#undef FMA
            }
        }
    }
    if (M == 1) s0 = _mm512_add_ps(s0, s1);
    const __m512 sums[MAXM] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int j = 0; j < M; j++) acc[j] = _mm512_reduce_add_ps(sums[j]);
    return cols64;
}

/* Row r's product, whole chunks of 64 columns whose blocks are whole chunks, against the inputs in the shifted
 * order (`shifted_order`): the permute reads the low 4 bits of each 32-bit lane, so the chunk's 64 index bytes are
 * looked up 16 at a time by shifting them 8 bits right between lookups (lane l at step t: column 4l + t), with
 * no widening or extraction. Returns the first column left to the portable loop. */
static inline AVX512 __attribute__((always_inline)) int64_t row_shifted(const weight_t *w, int64_t r, const float *xs,
                                                                       const int M, float *acc) {
    const int bits = w->bits;
    const int64_t cols64 = w->cols / 64 * 64;
    const uint8_t *row = w->packed + r * w->cols * bits / 8;
    const __m512i spread = _mm512_loadu_si512(w->spread), shifts = _mm512_loadu_si512(w->shifts);
    const __m512 raw_table = table512(w, r);
    const int64_t block = w->block;
    __m512 table = round_vec(raw_table, w->mode);
    int64_t next_block = 0, b = r * w->nblocks - 1;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int64_t c = 0; c < cols64; c += 64) {
        _mm_prefetch((const char *)(row + c * bits / 8) + PREFETCH_AHEAD, _MM_HINT_T0);
        if (block && c == next_block) {
            next_block += block;
            table = round_vec(_mm512_mul_ps(raw_table, _mm512_set1_ps(scale_at(w, ++b))), w->mode);
        }
        const __m512i idx8 = chunk_indices(row + c * bits / 8, bits, spread, shifts);
        for (int t = 0; t < 4; t++) {
            const __m512 v = _mm512_permutexvar_ps(t ? _mm512_srli_epi32(idx8, 8 * t) : idx8, table);
            const float *xt = xs + c + 16 * t;
#define FMA(j) \
    if (M > j) s##j = _mm512_fmadd_ps(v, _mm512_loadu_ps(xt + j * w->cols), s##j)
            if (M == 1 && (t & 1)) /* one token: two chains of sums */
                s1 = _mm512_fmadd_ps(v, _mm512_loadu_ps(xt), s1);
            else {
                FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5); FMA(6); FMA(7);
            }
#undef FMA
        }
    }
    if (M == 1) s0 = _mm512_add_ps(s0, s1);
    const __m512 sums[MAXM] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int j = 0; j < M; j++) acc[j] = _mm512_reduce_add_ps(sums[j]);
    return cols64;
}

#define ROWS_AVX512(M)                                                                                                \
    static AVX512 void row_avx512_##M(const weight_t *w, int64_t r, const float *x, const float *xs, float *acc,     \
                                      void *out) {                                                                    \
        int64_t c0 = xs ? row_shifted(w, r, xs, M, acc) : row_avx512(w, r, x, M, acc, out);                            \
        tail_portable(w, r, c0, x, M, acc, out);                                                                      \
    }
EACH_M(ROWS_AVX512)
static void (*const rows_avx512_m[MAXM + 1])(const weight_t *, int64_t, const float *, const float *, float *,
                                             void *) = BY_M(row_avx512);

/* 8-bit tables saved in 16 bits (an embedding / tied LM head: 256 entries in 8 registers of 32 words), chunks of
 * 32 columns: 32 indices widened to words, four two-register word permutes (64 entries each) and two blends on the
 * indices' top bits look all 32 up; widened to float32 they are scaled and rounded per weight (as the portable loop)
 * and multiplied into the float32 inputs by two accumulators per token. Returns the first column left over. */
static inline AVX512 __attribute__((always_inline)) int64_t row_bytes512(const weight_t *w, int64_t r,
                                                                        const __m512i *table, const float *x,
                                                                        const int M, float *acc, void *out) {
    const int64_t cols32 = w->cols / 32 * 32, block = w->block;
    const uint8_t *row = w->packed + r * w->cols;
    const __m512i bit6 = _mm512_set1_epi16(64), bit7 = _mm512_set1_epi16(128);
    const int round = w->mode != OUT_F32 && (block || w->lut_dtype != (w->mode == OUT_BF16 ? SCALE_BF16 : SCALE_F16));
    int64_t next_block = 0, b = r * w->nblocks - 1;
    __m512 sc = _mm512_set1_ps(1.0f);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    __m512 t0 = s0, t1 = s0, t2 = s0, t3 = s0, t4 = s0, t5 = s0, t6 = s0, t7 = s0;
    for (int64_t c = 0; c < cols32; c += 32) {
        if ((c & 63) == 0) _mm_prefetch((const char *)(row + c) + PREFETCH_AHEAD, _MM_HINT_T0);
        if (block && c == next_block) {
            next_block += block;
            sc = _mm512_set1_ps(scale_at(w, ++b));
        }
        const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + c)));
        const __m512i p0 = _mm512_permutex2var_epi16(table[0], idx, table[1]);
        const __m512i p1 = _mm512_permutex2var_epi16(table[2], idx, table[3]);
        const __m512i p2 = _mm512_permutex2var_epi16(table[4], idx, table[5]);
        const __m512i p3 = _mm512_permutex2var_epi16(table[6], idx, table[7]);
        const __mmask32 m6 = _mm512_test_epi16_mask(idx, bit6), m7 = _mm512_test_epi16_mask(idx, bit7);
        const __m512i words = _mm512_mask_blend_epi16(m7, _mm512_mask_blend_epi16(m6, p0, p1),
                                                      _mm512_mask_blend_epi16(m6, p2, p3));
        const __m256i wl = _mm512_castsi512_si256(words), wh = _mm512_extracti64x4_epi64(words, 1);
        __m512 lo, hi;
        if (w->lut_dtype == SCALE_BF16) {
            lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(wl), 16));
            hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(wh), 16));
        } else {
            lo = _mm512_cvtph_ps(wl);
            hi = _mm512_cvtph_ps(wh);
        }
        if (block) lo = _mm512_mul_ps(lo, sc), hi = _mm512_mul_ps(hi, sc);
        if (round) lo = round_vec(lo, w->mode), hi = round_vec(hi, w->mode);
        if (out) {
            if (w->mode == OUT_F32) {
                _mm512_storeu_ps((float *)out + c, lo);
                _mm512_storeu_ps((float *)out + c + 16, hi);
            } else if (w->mode == OUT_BF16) {
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + c),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + c + 16),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
            } else {
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + c),
                                    _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + c + 16),
                                    _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
            continue;
        }
#define FMA2(j)                                                                                                      \
    if (M > j) {                                                                                                     \
        s##j = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + j * w->cols + c), s##j);                                      \
        t##j = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + j * w->cols + c + 16), t##j);                                 \
    }
        FMA2(0); FMA2(1); FMA2(2); FMA2(3); FMA2(4); FMA2(5); FMA2(6); FMA2(7);
#undef FMA2
    }
    const __m512 sums[MAXM] = {_mm512_add_ps(s0, t0), _mm512_add_ps(s1, t1), _mm512_add_ps(s2, t2),
                               _mm512_add_ps(s3, t3), _mm512_add_ps(s4, t4), _mm512_add_ps(s5, t5),
                               _mm512_add_ps(s6, t6), _mm512_add_ps(s7, t7)};
    for (int j = 0; j < M; j++) acc[j] = _mm512_reduce_add_ps(sums[j]);
    return cols32;
}

#define ROWS_BYTES512(M)                                                                                              \
    static AVX512 void bytes512_##M(const weight_t *w, int64_t r, const __m512i *table, const float *x, float *acc,  \
                                    void *out) {                                                                     \
        int64_t c0 = row_bytes512(w, r, table, x, M, acc, out);                                                       \
        tail_portable(w, r, c0, x, M, acc, out);                                                                      \
    }
EACH_M(ROWS_BYTES512)
static void (*const bytes512_m[MAXM + 1])(const weight_t *, int64_t, const __m512i *, const float *, float *,
                                          void *) = BY_M(bytes512);

/* Rows [r0, r1) of an 8-bit weight whose tables are saved in 16 bits (level(): the AVX-512 loop takes it). */
static AVX512 void rows_bytes512(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out) {
    __m512i table[8];
    int64_t group = -1;
    for (int64_t r = r0; r < r1; r++) {
        if (r / w->rows_per_group != group) {
            group = r / w->rows_per_group;
            const uint16_t *first = (const uint16_t *)w->lut + group * 256;
            for (int k = 0; k < 8; k++) table[k] = _mm512_loadu_si512(first + 32 * k);
        }
        float acc[MAXM] = {0};
        bytes512_m[out ? 1 : in->m](w, r, table, out ? 0 : in->xf, acc, out_row_of(w, out, r));
        for (int64_t j = 0; !out && j < in->m; j++) y[j * w->rows + r] = acc[j];
    }
}

/* Rows [r0, r1): y[j, r] of float32 x (natural order), or the decoded rows into out. */
static void rows_avx512(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out) {
    if (w->bits == 8) {
        rows_bytes512(w, r0, r1, in, y, out);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        float acc[MAXM] = {0};
        rows_avx512_m[out ? 1 : in->m](w, r, out ? 0 : in->xf, out ? 0 : in->xt, acc, out_row_of(w, out, r));
        for (int64_t j = 0; !out && j < in->m; j++) y[j * w->rows + r] = acc[j];
    }
}

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
            if (M == 1 && h) /* one token: two chains of sums */
                s1 = _mm512_dpbf16_ps(s1, v, (__m512bh)_mm512_loadu_si512(x + col));
            else {
                DOT(0); DOT(1); DOT(2); DOT(3); DOT(4); DOT(5); DOT(6); DOT(7);
            }
#undef DOT
        }
    }
#undef WORDS
    if (M == 1) s0 = _mm512_add_ps(s0, s1);
    const __m512 sums[MAXM] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int j = 0; j < M; j++) acc[j] = _mm512_reduce_add_ps(sums[j]);
    return cols64;
}

#define ROWS_BF16(M)                                                                                                  \
    static AVX512BF16 void row_bf16_##M(const weight_t *w, int64_t r, const void *x, const float *xf, float *acc) {  \
        int64_t c0 = row_bf16(w, r, (const uint16_t *)x, M, acc);                                                     \
        tail_portable(w, r, c0, xf, M, acc, 0);                                                                       \
    }
EACH_M(ROWS_BF16)
static void (*const rows_bf16_m[MAXM + 1])(const weight_t *, int64_t, const void *, const float *, float *) =
    BY_M(row_bf16);

/* Rows [r0, r1): y[j, r] of bfloat16 x (the tails read its float32 copy). */
static void rows_avx512bf16(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y) {
    for (int64_t r = r0; r < r1; r++) {
        float acc[MAXM] = {0};
        rows_bf16_m[in->m](w, r, in->x, in->xf, acc);
        for (int64_t j = 0; j < in->m; j++) y[j * w->rows + r] = acc[j];
    }
}

#endif
