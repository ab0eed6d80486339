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
    static AVX512 void row_avx512_##M(const weight_t *w, int64_t r, const float *x, float *acc, void *out) {          \
        int64_t c0 = row_avx512(w, r, x, M, acc, out);                                                                \
        tail_portable(w, r, c0, x, M, acc, out);                                                                      \
    }
EACH_M(ROWS_AVX512)
static void (*const rows_avx512_m[MAXM + 1])(const weight_t *, int64_t, const float *, float *, void *) =
    BY_M(row_avx512);

/* Rows [r0, r1): y[j, r] of float32 x (natural order), or the decoded rows into out. */
static void rows_avx512(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out) {
    for (int64_t r = r0; r < r1; r++) {
        float acc[MAXM] = {0};
        rows_avx512_m[out ? 1 : in->m](w, r, out ? 0 : in->xf, acc, out_row_of(w, out, r));
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
