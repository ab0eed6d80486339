/* The NEON loops of the DKM CPU kernel (every AArch64 CPU: Apple silicon, Graviton, Ampere), for tables of up to 16
 * entries (1-4 bits) with block scales of whole 8-column words or none. Compiled after `_lut_native.c`, as one
 * translation unit with it; larger tables and other blocks take the portable loop.
 *
 * A row is read 16 indices at a time (2 * bits bytes): one byte-table lookup (`tbl`) moves the byte (two bytes at 3
 * bits) that holds each index into its lane, one per-lane shift and a mask leave the index. The table (the row's, or
 * each block's scaled and rounded once) is held as its four byte planes (one `ld4`): four `tbl`s look 16 entries'
 * bytes up and two rounds of zips put them back together as four vectors of 4 float32 weights (in a bfloat16
 * product, whose tables are rounded to bfloat16, two lookups in the high planes and one widening each).
 *
 * Bit for bit the portable loop's sums: each lane accumulates the columns the portable loop's matching scalar does
 * (columns 8i + t into lane t of the pair lo = t 0-3, hi = t 4-7), one multiply then one add (the kernel is built
 * with `-ffp-contract=off`, so neither loop fuses them), reduced in the same order at the row's end.
 */
#ifdef HAVE_NEON
#define INLINE_NEON static inline __attribute__((always_inline))

/* A table of up to 16 float32 entries (the rest zero) as its byte planes: plane b holds byte b of every entry. */
INLINE_NEON uint8x16x4_t table_planes(const float *table, const int bits) {
    float t[16] = {0};
    for (int i = 0; i < (1 << bits); i++) t[i] = table[i];
    return vld4q_u8((const uint8_t *)t);
}

/* Entries idx[0..15] of the table in `planes`, as 4 vectors of 4 float32 (v[i]: entries of idx[4i..4i+3]). `bf16`:
 * a table rounded to bfloat16 (its entries' two low bytes are zero), looked up in the two high planes only. */
INLINE_NEON void lookup16(const uint8x16x4_t planes, const uint8x16_t idx, float32x4_t v[4], const int bf16) {
    const uint8x16_t b2 = vqtbl1q_u8(planes.val[2], idx), b3 = vqtbl1q_u8(planes.val[3], idx);
    const uint16x8_t lo23 = vreinterpretq_u16_u8(vzip1q_u8(b2, b3)), hi23 = vreinterpretq_u16_u8(vzip2q_u8(b2, b3));
    if (bf16) {
        v[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(lo23), 16));
        v[1] = vreinterpretq_f32_u32(vshll_high_n_u16(lo23, 16));
        v[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(hi23), 16));
        v[3] = vreinterpretq_f32_u32(vshll_high_n_u16(hi23, 16));
        return;
    }
    const uint8x16_t b0 = vqtbl1q_u8(planes.val[0], idx), b1 = vqtbl1q_u8(planes.val[1], idx);
    const uint16x8_t lo01 = vreinterpretq_u16_u8(vzip1q_u8(b0, b1)), hi01 = vreinterpretq_u16_u8(vzip2q_u8(b0, b1));
    v[0] = vreinterpretq_f32_u16(vzip1q_u16(lo01, lo23));
    v[1] = vreinterpretq_f32_u16(vzip2q_u16(lo01, lo23));
    v[2] = vreinterpretq_f32_u16(vzip1q_u16(hi01, hi23));
    v[3] = vreinterpretq_f32_u16(vzip2q_u16(hi01, hi23));
}

/* How 16 indices of `bits` bits come out of their 2 * bits bytes: at 1, 2 and 4 bits each index lies in one byte
 * (byte[i] = the byte of index i, shift8[i] = minus its bit offset there); at 3 bits in two (pair0 / pair1: the two
 * bytes of indices 0-7 / 8-15 as 16-bit lanes, shift16: minus the offsets). */
typedef struct {
    uint8x16_t byte, pair0, pair1, mask;
    int8x16_t shift8;
    int16x8_t shift16[2];
    const uint8_t *end; /* one past the stream's last byte */
} unpack_t;

static unpack_t make_unpack(const weight_t *w) {
    const int bits = w->bits;
    uint8_t byte[16], pairs[32];
    int8_t shift8[16];
    int16_t shift16[16];
    for (int i = 0; i < 16; i++) {
        byte[i] = (uint8_t)(i * bits / 8);
        shift8[i] = (int8_t)-(i * bits % 8);
        pairs[2 * i] = (uint8_t)(i * bits / 8);
        pairs[2 * i + 1] = (uint8_t)(i * bits / 8 + 1);
        shift16[i] = (int16_t)-(i * bits % 8);
    }
    unpack_t u;
    u.byte = vld1q_u8(byte);
    u.pair0 = vld1q_u8(pairs);
    u.pair1 = vld1q_u8(pairs + 16);
    u.mask = vdupq_n_u8((uint8_t)((1 << bits) - 1));
    u.shift8 = vld1q_s8(shift8);
    u.shift16[0] = vld1q_s16(shift16);
    u.shift16[1] = vld1q_s16(shift16 + 8);
    u.end = w->end;
    return u;
}

/* The (up to) 16 indices whose `n` bytes start at p, never reading past the stream's end. */
INLINE_NEON uint8x16_t indices16(const uint8_t *end, const unpack_t *u, const uint8_t *p, const int64_t n,
                                 const int three) {
    uint64_t word = 0;
    if (p + 8 <= end) memcpy(&word, p, 8);
    else memcpy(&word, p, (size_t)n);
    const uint8x16_t bytes = vcombine_u8(vcreate_u8(word), vdup_n_u8(0));
    if (!three) return vandq_u8(vshlq_u8(vqtbl1q_u8(bytes, u->byte), u->shift8), u->mask);
    const uint16x8_t i0 = vshlq_u16(vreinterpretq_u16_u8(vqtbl1q_u8(bytes, u->pair0)), u->shift16[0]);
    const uint16x8_t i1 = vshlq_u16(vreinterpretq_u16_u8(vqtbl1q_u8(bytes, u->pair1)), u->shift16[1]);
    return vandq_u8(vmovn_high_u16(vmovn_u16(i0), i1), u->mask);
}

/* 4 weights stored at out_row[c..c+3] in the mode's dtype: their values are that dtype's already, so each store is
 * exact (as `store_to` of the portable loop). */
INLINE_NEON void store4(void *out_row, int64_t c, float32x4_t v, int mode) {
    if (mode == OUT_BF16) vst1_u16((uint16_t *)out_row + c, vshrn_n_u32(vreinterpretq_u32_f32(v), 16));
    else if (mode == OUT_F16) vst1_u16((uint16_t *)out_row + c, vreinterpret_u16_f16(vcvt_f16_f32(v)));
    else vst1q_f32((float *)out_row + c, v);
}

/* Columns c.. of a row (16, or 8 where not `whole`) against M tokens (lane t of lo[j] / hi[j] summing columns
 * 8i + t / 8i + 4 + t of token j, as the portable loop's sums[j][t]), or decoded into out_row (M = 0). */
INLINE_NEON void step(const weight_t *w, const unpack_t *u, const uint8x16x4_t planes, const uint8_t *row, int64_t c,
                      const float *x, void *out_row, float32x4_t *lo, float32x4_t *hi, const int three, const int M,
                      const int whole) {
    const int bits = w->bits;
    const uint8_t *p = row + ((uint64_t)c * (uint64_t)bits >> 3);
    if ((c & 63) == 0) __builtin_prefetch(p + PREFETCH_AHEAD);
    float32x4_t v[4];
    lookup16(planes, indices16(u->end, u, p, whole ? 2 * bits : bits, three), v, w->mode == OUT_BF16);
    if (!M)
        for (int i = 0; i < (whole ? 4 : 2); i++) store4(out_row, c + 4 * i, v[i], w->mode);
    for (int j = 0; j < M; j++) {
        const float *xj = x + j * w->cols + c;
        lo[j] = vaddq_f32(lo[j], vmulq_f32(v[0], vld1q_f32(xj)));
        hi[j] = vaddq_f32(hi[j], vmulq_f32(v[1], vld1q_f32(xj + 4)));
        if (whole) {
            lo[j] = vaddq_f32(lo[j], vmulq_f32(v[2], vld1q_f32(xj + 8)));
            hi[j] = vaddq_f32(hi[j], vmulq_f32(v[3], vld1q_f32(xj + 12)));
        }
    }
}

/* Rows [r0, r1) of a table of up to 16 entries: M tokens (1, 2, 4 or 8) into y[j, r], or (M = 0) decoded into out.
 * `three`: 3-bit indices (two bytes each to unpack), a constant, as M is (the accumulators are registers). */
INLINE_NEON void rows_lut_neon(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out,
                               const int three, const int M) {
    const int bits = w->bits;
    const int64_t cols = w->cols, block = w->block;
    const float *x = M ? in->xf : 0;
    const unpack_t u = make_unpack(w);
    float raw[16], base[16], scaled[16];
    uint8x16x4_t planes_base = {{vdupq_n_u8(0), vdupq_n_u8(0), vdupq_n_u8(0), vdupq_n_u8(0)}};
    int64_t group = -1;
    for (int64_t r = r0; r < r1; r++) {
        if (r / w->rows_per_group != group) { /* each group's table is read (and, without scales, rounded) once */
            group = r / w->rows_per_group;
            row_tables(w, r, raw, base);
            if (!block) planes_base = table_planes(base, bits);
        }
        const uint8_t *row = row_bytes(w, r);
        void *out_row = M ? 0 : out_row_of(w, out, r);
        float32x4_t lo[MAXM], hi[MAXM];
        for (int j = 0; j < M; j++) lo[j] = hi[j] = vdupq_n_f32(0.0f);
        for (int64_t c = 0; c < cols;) {
            int64_t end = cols;
            uint8x16x4_t planes = planes_base;
            if (block) { /* c starts a block: its table scaled and rounded once, as the portable loop's `scaled` */
                const float s = scale_at(w, r * w->nblocks + c / block);
                for (int i = 0; i < (1 << bits); i++) scaled[i] = round_to(raw[i] * s, w->mode);
                planes = table_planes(scaled, bits);
                end = c + block;
            }
            for (; c + 16 <= end; c += 16) step(w, &u, planes, row, c, x, out_row, lo, hi, three, M, 1);
            if (c < end) { /* the last 8 columns of the block or row */
                step(w, &u, planes, row, c, x, out_row, lo, hi, three, M, 0);
                c += 8;
            }
        }
        if (M == 1) { /* the portable loop's ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), added to acc = 0 */
            const float32x4_t pairs = vpaddq_f32(lo[0], hi[0]);
            const float total = (vgetq_lane_f32(pairs, 0) + vgetq_lane_f32(pairs, 1)) +
                                (vgetq_lane_f32(pairs, 2) + vgetq_lane_f32(pairs, 3));
            float acc = 0.0f;
            acc += total;
            y[r] = acc;
        } else
            for (int j = 0; j < M; j++) { /* the portable loop's s = 0 + sums[j][0] + ... + sums[j][7], acc = 0 + s */
                float lanes[8], s = 0.0f, acc = 0.0f;
                vst1q_f32(lanes, lo[j]);
                vst1q_f32(lanes + 4, hi[j]);
                for (int t = 0; t < 8; t++) s += lanes[t];
                acc += s;
                y[j * w->rows + r] = acc;
            }
    }
}

/* Compiled for 1, 2, 4 and 8 tokens (other counts run padded with zero inputs, as the AVX2 loops' are: each token's
 * sums are its own, so padding changes no bit), 3-bit indices or others. */
typedef void (*neon_rows_fn)(const weight_t *, int64_t, int64_t, const input_t *, float *);
#define NEON_ROWS(M)                                                                                                  \
    static void neon_##M(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y) {                   \
        rows_lut_neon(w, r0, r1, in, y, 0, 0, M);                                                                     \
    }                                                                                                                 \
    static void neon3_##M(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y) {                  \
        rows_lut_neon(w, r0, r1, in, y, 0, 1, M);                                                                     \
    }
EACH_M_AVX2(NEON_ROWS)
static const neon_rows_fn neon_rows[2][MAXM + 1] = {BY_M_AVX2(neon), BY_M_AVX2(neon3)};

static void rows_neon(const weight_t *w, int64_t r0, int64_t r1, const input_t *in, float *y, void *out) {
    if (out && w->bits == 3) rows_lut_neon(w, r0, r1, 0, 0, out, 1, 0);
    else if (out) rows_lut_neon(w, r0, r1, 0, 0, out, 0, 0);
    else neon_rows[w->bits == 3][in->m](w, r0, r1, in, y);
}
#endif
