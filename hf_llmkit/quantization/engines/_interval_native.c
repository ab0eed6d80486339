/* DKM's soft assignment of scalar weights on the CPU: the interval engine's closed form (engines/interval.py), one
 * pass over the points per clustering iteration, forward and backward, with everything of the size of the table
 * (the per-interval constants, the centroid updates and their derivatives) computed here in double precision.
 *
 * Points: a [rows, cols] matrix of float32 or bfloat16 values `w`, optionally divided by block scales
 * (`scales` [rows, cols / block], float32: the point is w / s, its output o(w / s) * s) and optionally counted with
 * multiplicities (`mult` [rows, cols], float64: a unique value standing for that many weights), or weighted in the
 * k-means step by an importance per column (`imp` [cols], float32: a point counts imp s^2 in the sums, its input
 * feature's energy times its block scale squared, as `calibrate` weighs it; NULL: every point counts 1). Groups of
 * `rows / groups` consecutive rows share a table of K = 2^bits centroids.
 *
 * Sort a group's centroids c_0 <= ... <= c_{K-1}. A point v lies in interval j = #{k : c_k < v} (0..K); there its
 * attention over the centroids is a_k = u P_jk (k < j), (1 - u) Q_jk (k >= j), with the left share
 *     u = sigmoid(kappa (m_j - v) + l_j),  kappa = 2 / tau,  m_j = (c_{j-1} + c_j) / 2,  l_j = log(L_j / R_j),
 * L_j = sum_{k<j} e^{-(c_{j-1} - c_k) / tau}, R_j = sum_{k>=j} e^{-(c_k - c_j) / tau}, P, Q their normalised terms
 * (u = 0 in interval 0, 1 in interval K). DKM's output is o = B_j + (A_j - B_j) u (A_j, B_j the left and right
 * attention-weighted centroids) and its k-means step c_k <- num_k / den_k needs, per interval, only the sums
 * N = sum h, Su = sum h u, Suv = sum h u v, Sv = sum h v (h the point's importance, 1 without), contracted with P
 * and Q.
 *
 * Forward (`dkm_forward`): per iteration one pass accumulates the four sums per interval (in double, per chunk of
 * points, the chunks reduced in a fixed order: the result does not depend on the number of threads), then the
 * centroids update; iterations stop once no centroid of any group moved more than its epsilon; a last pass writes
 * the output. Saved for backward: the centroids of every iteration and their sums (table-sized), nothing per point.
 * Backward (`dkm_backward`): one pass for the output (its gradient and, for the input gradient, the output again),
 * then one pass per iteration in reverse, each after the table-sized derivatives of the step after it.
 * exp is computed as 2^n e^r (|r| <= ln2 / 2, a degree-7 Taylor polynomial, 2^n through the exponent bits);
 * tests/quantization/test_interval_kernel.py holds every output to the torch engine within float32 rounding.
 * The per-point loops are compiled twice, for AVX2 with FMA (chosen at run time) and portably.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAXK 256
#define BLK 32              /* points per block of the vectorised loops */
#define CHUNK_POINTS 16384  /* points per chunk of work (and of partial sums) */
#define LANES 8             /* copies of a chunk's sums, point i adding to copy i % LANES: no chain of adds */

enum { SRC_F32 = 0, SRC_BF16 = 1 };

static inline __attribute__((always_inline)) float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 87.0f ? 87.0f : x;
    float n = __builtin_roundf(x * 1.4426950408889634f);
    float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f; /* ln2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

static inline __attribute__((always_inline)) float bf16_value(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* x rounded to the nearest bfloat16 (ties to even), as a float (finite x) */
static inline __attribute__((always_inline)) float bf16_round(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* ---- the per-point loops: one block of n <= BLK points of one group, all with the same scale ---------------- */

typedef struct {   /* one group's float constants for the per-point loops of one stage */
    const float *cs; /* sorted centroids, padded with +inf to 2K (the search) */
    const float *m, *l, *b, *d; /* [K + 1] */
    const float *lu, *luv, *lv; /* [K + 1]: the derivatives of the step's sums (backward) */
    float kappa;
    int k;
} consts_t;

/* interval j and left share u of each of BLK points v (the loops have a fixed length: they vectorise whole) */
static inline __attribute__((always_inline)) void locate(const consts_t *t, const float *v, int *j, float *u) {
    int k = t->k;
    for (int i = 0; i < BLK; i++) j[i] = 0;
    if (k <= 16) {
        for (int c = 0; c < k; c++) {
            float cc = t->cs[c];
            for (int i = 0; i < BLK; i++) j[i] += cc < v[i] ? 1 : 0;
        }
    } else {
        for (int step = k; step >= 1; step >>= 1)
            for (int i = 0; i < BLK; i++) j[i] += t->cs[j[i] + step - 1] < v[i] ? step : 0;
    }
    float kappa = t->kappa;
    for (int i = 0; i < BLK; i++) {
        int ji = j[i];
        float e = exp_approx(kappa * (v[i] - t->m[ji]) - t->l[ji]);
        float s = 1.0f / (1.0f + e);
        u[i] = ji == 0 ? 0.0f : (ji == k ? 1.0f : s);
    }
}

/* the values of n <= BLK points, src[i] / scale (float32 or bfloat16 source), the last repeated up to BLK */
static inline __attribute__((always_inline)) void load(const void *src, int kind, int64_t at, float scale, int n,
                                                       float *v) {
    float raw[BLK];
    if (kind == SRC_BF16) {
        const uint16_t *s = (const uint16_t *)src + at;
        if (n == BLK)
            for (int i = 0; i < BLK; i++) raw[i] = bf16_value(s[i]);
        else
            for (int i = 0; i < BLK; i++) raw[i] = bf16_value(s[i < n ? i : n - 1]);
    } else {
        const float *s = (const float *)src + at;
        if (n == BLK)
            for (int i = 0; i < BLK; i++) raw[i] = s[i];
        else
            for (int i = 0; i < BLK; i++) raw[i] = s[i < n ? i : n - 1];
    }
    for (int i = 0; i < BLK; i++) v[i] = raw[i] / scale;
}

enum { OP_SUMS = 0, OP_OUT = 1, OP_OUT_BWD = 2, OP_STEP_BWD = 3 };

typedef struct {   /* what one pass reads and writes besides the points */
    const double *mult; /* [rows, cols] or NULL */
    const float *g;     /* OP_OUT_BWD: the output's gradient [rows, cols] */
    const double *gsum; /* ... or, for unique points, its sum over their weights (the derivative alone is written) */
    float *out;         /* OP_OUT / OP_OUT_BWD: the output o * s [rows, cols] (OP_OUT_BWD: may be NULL) */
    float *grad;        /* OP_OUT_BWD: written, OP_STEP_BWD: added to (d loss / d w) [rows, cols] */
    int round_bf16;     /* round the output to bfloat16 */
    const float *imp;   /* OP_SUMS, OP_STEP_BWD: each column's importance [cols] (a point counts imp s^2), or NULL */
} io_t;

typedef double sum4 __attribute__((vector_size(32), aligned(8)));

/* the output o * s of BLK points, rounded to bfloat16 values with `round` */
static inline __attribute__((always_inline)) void output(const consts_t *t, const int *j, const float *u,
                                                         float scale, int round, float *x) {
    for (int i = 0; i < BLK; i++) x[i] = (t->b[j[i]] + t->d[j[i]] * u[i]) * scale;
    if (round)
        for (int i = 0; i < BLK; i++) x[i] = bf16_round(x[i]);
}

/* the sums of n <= BLK points into `acc` [K + 1][LANES][4], point i into copy i % LANES of its interval:
 * sum[j][i % LANES][0..3] += (a, b, c, d)[i] (a copy's place is its interval's plus a constant) */
static inline __attribute__((always_inline)) void scatter4_any(double *restrict acc, const int *restrict j, int n,
                                                               const float *a, const float *b, const float *c,
                                                               const float *d) {
    sum4 *restrict a4 = (sum4 *)acc;
    sum4 q[BLK];
    for (int i = 0; i < BLK; i++) q[i] = (sum4){a[i], b[i], c[i], d[i]};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) a4[j[i + l] * LANES + l] += q[i + l];
    for (; i < n; i++) a4[j[i] * LANES + (i & (LANES - 1))] += q[i];
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* the same with AVX: four points' (a, b, c, d) transposed in registers, widened to double and added at once */
__attribute__((target("avx2,fma"))) static void scatter4_avx2(double *restrict acc, const int *restrict j, int n,
                                                              const float *a, const float *b, const float *c,
                                                              const float *d) {
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int h = 0; h < LANES; h += 4) {
            __m128 p0 = _mm_loadu_ps(a + i + h), p1 = _mm_loadu_ps(b + i + h);
            __m128 p2 = _mm_loadu_ps(c + i + h), p3 = _mm_loadu_ps(d + i + h);
            __m128 t0 = _mm_unpacklo_ps(p0, p1), t1 = _mm_unpacklo_ps(p2, p3);
            __m128 t2 = _mm_unpackhi_ps(p0, p1), t3 = _mm_unpackhi_ps(p2, p3);
            __m128 q[4] = {_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0), _mm_movelh_ps(t2, t3), _mm_movehl_ps(t3, t2)};
            for (int l = 0; l < 4; l++) {
                double *dst = acc + 4 * (j[i + h + l] * LANES + h + l);
                _mm256_storeu_pd(dst, _mm256_add_pd(_mm256_loadu_pd(dst), _mm256_cvtps_pd(q[l])));
            }
        }
    }
    for (; i < n; i++) {
        double *dst = acc + 4 * (j[i] * LANES + (i & (LANES - 1)));
        dst[0] += a[i];
        dst[1] += b[i];
        dst[2] += c[i];
        dst[3] += d[i];
    }
}
#define SCATTER4(level, ...) ((level) ? scatter4_avx2(__VA_ARGS__) : scatter4_any(__VA_ARGS__))
#else
#define SCATTER4(level, ...) scatter4_any(__VA_ARGS__)
#endif

static inline __attribute__((always_inline)) void scatter1(double *restrict acc, const int *restrict j,
                                                           int n, const float *restrict a) {
    double q[BLK];
    for (int i = 0; i < BLK; i++) q[i] = a[i];
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[4 * (j[i + l] * LANES + l)] += q[i + l];
    for (; i < n; i++) acc[4 * (j[i] * LANES + (i & (LANES - 1)))] += q[i];
}

/* one block of n <= BLK points at `at`: acc [LANES][K + 1] x 4 doubles (OP_SUMS: N, Su, Suv, Sv; OP_OUT_BWD:
 * sum g u, sum g (1 - u), sum g d u (1 - u); OP_STEP_BWD: sum m (lu + luv v) u (1 - u)) */
static inline __attribute__((always_inline)) void block(int level, int op, const consts_t *t, const void *src,
                                                        int kind, int64_t at, int64_t col, float scale, int n,
                                                        const io_t *io, double *restrict acc) {
    float v[BLK], u[BLK], x[BLK], y[BLK], z[BLK], one[BLK], h[BLK];
    int j[BLK];
    load(src, kind, at, scale, n, v);
    locate(t, v, j, u);
    const double *mult = io->mult ? io->mult + at : NULL;
    if (io->imp) { /* the points' importance imp s^2 (past n: the last one's, like their values) */
        const float *imp = io->imp + col;
        float s2 = scale * scale;
        for (int i = 0; i < BLK; i++) h[i] = imp[i < n ? i : n - 1] * s2;
    }
    if (op == OP_SUMS) {
        if (io->imp) {
            for (int i = 0; i < BLK; i++) {
                y[i] = h[i] * u[i];
                x[i] = y[i] * v[i];
                z[i] = h[i] * v[i];
            }
            SCATTER4(level, acc, j, n, h, y, x, z);
        } else if (mult) {
            for (int i = 0; i < n; i++) {
                one[i] = (float)mult[i]; /* counts of 16-bit patterns: exact in float up to 2^24 */
                y[i] = one[i] * u[i];
                x[i] = y[i] * v[i];
                z[i] = one[i] * v[i];
            }
            SCATTER4(level, acc, j, n, one, y, x, z);
        } else {
            for (int i = 0; i < BLK; i++) {
                one[i] = 1.0f;
                x[i] = u[i] * v[i];
            }
            SCATTER4(level, acc, j, n, one, u, x, v);
        }
    } else if (op == OP_OUT) {
        output(t, j, u, scale, io->round_bf16, x);
        float *restrict o = io->out + at;
        for (int i = 0; i < n; i++) o[i] = x[i];
    } else if (op == OP_OUT_BWD) {
        if (io->g) { /* the gradient of o = (w_c / s): g s */
            const float *g = io->g + at;
            if (n == BLK)
                for (int i = 0; i < BLK; i++) y[i] = g[i] * scale;
            else
                for (int i = 0; i < BLK; i++) y[i] = g[i < n ? i : 0] * scale;
        } else {
            for (int i = 0; i < BLK; i++) y[i] = 1.0f;
        }
        float mk = -t->kappa / scale;
        for (int i = 0; i < BLK; i++) z[i] = t->d[j[i]] * u[i] * (1.0f - u[i]); /* d u (1 - u) */
        for (int i = 0; i < BLK; i++) x[i] = y[i] * z[i] * mk;
        float *restrict grad = io->grad + at;
        for (int i = 0; i < n; i++) grad[i] = x[i];
        if (io->out) {
            output(t, j, u, scale, io->round_bf16, x);
            float *restrict o = io->out + at;
            for (int i = 0; i < n; i++) o[i] = x[i];
        }
        if (io->gsum)
            for (int i = 0; i < n; i++) y[i] = (float)io->gsum[at + i];
        for (int i = 0; i < BLK; i++) {
            x[i] = y[i] * u[i];
            one[i] = y[i] - x[i];
            z[i] *= y[i];
            v[i] = 0.0f;
        }
        SCATTER4(level, acc, j, n, x, one, z, v);
    } else { /* OP_STEP_BWD */
        float mk = -t->kappa;
        for (int i = 0; i < BLK; i++) {
            float q = t->lu[j[i]] + t->luv[j[i]] * v[i], sl = u[i] * (1.0f - u[i]);
            x[i] = (q * sl * mk + t->luv[j[i]] * u[i] + t->lv[j[i]]) / scale;
            y[i] = q * sl;
        }
        if (io->imp) /* d/dv of the weighted sums: the point's importance times the unweighted ones' */
            for (int i = 0; i < BLK; i++) {
                x[i] *= h[i];
                y[i] *= h[i];
            }
        float *restrict grad = io->grad + at;
        for (int i = 0; i < n; i++) grad[i] += x[i];
        if (mult)
            for (int i = 0; i < n; i++) y[i] *= (float)mult[i];
        scatter1(acc, j, n, y);
    }
}

/* a run of points of one row: [c0, c1) of row r, scale blocks of `bs` columns (0: no scales) */
static inline __attribute__((always_inline)) void run_row(int level, int op, const consts_t *t, const void *src,
                                                          int kind,
                                                          int64_t r, int64_t cols, const float *scales, int64_t bs,
                                                          const io_t *io, double *acc) {
    int64_t base = r * cols;
    for (int64_t c = 0; c < cols;) {
        int64_t end = bs ? c + bs : cols;
        float s = bs ? scales[r * (cols / bs) + c / bs] : 1.0f;
        while (c < end) {
            int n = end - c < BLK ? (int)(end - c) : BLK;
            block(level, op, t, src, kind, base + c, c, s, n, io, acc);
            c += n;
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86 1
__attribute__((target("avx2,fma"))) static void row_avx2(int op, const consts_t *t, const void *src, int kind,
                                                          int64_t r, int64_t cols, const float *scales, int64_t bs,
                                                          const io_t *io, double *acc) {
    run_row(1, op, t, src, kind, r, cols, scales, bs, io, acc);
}
#endif

static void row_portable(int op, const consts_t *t, const void *src, int kind, int64_t r, int64_t cols,
                         const float *scales, int64_t bs, const io_t *io, double *acc) {
    run_row(0, op, t, src, kind, r, cols, scales, bs, io, acc);
}

static int max_level = 1; /* dkm_max_level(0) keeps the portable loops (tests compare them) */

void dkm_max_level(int level) { max_level = level; }

/* 1: the AVX2 loops serve on this CPU, 0: the portable ones */
int dkm_level(void) { return max_level >= 1 && cpu_has_avx2_fma(); }

/* ---- a problem: its shape, its groups, its chunks -------------------------------------------------------------- */

typedef struct {
    const void *src;
    int kind;
    int64_t rows, cols, groups, per_group, bs;
    const float *scales;
    int k;
    int64_t chunk_rows, chunks_per_group, chunks;
} problem_t;

static problem_t make_problem(const void *src, int kind, int64_t rows, int64_t cols, int64_t groups,
                              const float *scales, int64_t bs, int k) {
    problem_t p = {src, kind, rows, cols, groups, rows / groups, scales ? bs : 0, scales, k, 0, 0, 0};
    p.chunk_rows = CHUNK_POINTS / (cols > 0 ? cols : 1);
    if (p.chunk_rows < 1) p.chunk_rows = 1;
    if (p.chunk_rows > p.per_group) p.chunk_rows = p.per_group;
    p.chunks_per_group = (p.per_group + p.chunk_rows - 1) / p.chunk_rows;
    p.chunks = p.chunks_per_group * groups;
    return p;
}

/* one pass over every point: `acc` [groups][K + 1][4] receives each group's sums (partials per chunk, reduced in
 * chunk order) */
static void pass(const problem_t *p, int op, const consts_t *consts, const io_t *io, double *acc, int threads) {
    int64_t width = 4 * (int64_t)(p->k + 1), lanes = LANES * width;
    double *part = calloc((size_t)(p->chunks * width), sizeof(double));
    int avx2 = dkm_level();
    (void)threads;
    (void)avx2;
#pragma omp parallel num_threads(threads) if (threads > 1 && p->chunks > 1)
    {
        double *copies = malloc((size_t)lanes * sizeof(double)); /* this thread's LANES copies of a chunk's sums */
#pragma omp for schedule(dynamic, 1)
        for (int64_t ch = 0; ch < p->chunks; ch++) {
            int64_t g = ch / p->chunks_per_group;
            int64_t r0 = g * p->per_group + (ch % p->chunks_per_group) * p->chunk_rows;
            int64_t r1 = r0 + p->chunk_rows;
            if (r1 > (g + 1) * p->per_group) r1 = (g + 1) * p->per_group;
            memset(copies, 0, (size_t)lanes * sizeof(double));
            for (int64_t r = r0; r < r1; r++) {
#ifdef HAVE_X86
                if (avx2) {
                    row_avx2(op, consts + g, p->src, p->kind, r, p->cols, p->scales, p->bs, io, copies);
                    continue;
                }
#endif
                row_portable(op, consts + g, p->src, p->kind, r, p->cols, p->scales, p->bs, io, copies);
            }
            double *mine = part + ch * width; /* the copies added in a fixed order: the chunk's partial sums */
            for (int64_t l = 0; l < LANES; l++)
                for (int64_t i = 0; i < width; i++) mine[i] += copies[(i / 4 * LANES + l) * 4 + i % 4];
        }
        free(copies);
    }
    if (acc) {
        memset(acc, 0, (size_t)(p->groups * width) * sizeof(double));
        for (int64_t ch = 0; ch < p->chunks; ch++) {
            double *a = acc + (ch / p->chunks_per_group) * width;
            for (int64_t i = 0; i < width; i++) a[i] += part[ch * width + i];
        }
    }
    free(part);
}

/* ---- a group's table at one stage: sorted centroids and the per-interval constants, in double ------------------ */

typedef struct {
    int k;
    double tau;
    double *c;            /* [K] sorted */
    int *order;           /* [K] sorted position -> slot */
    double *big_l, *big_r; /* [K + 1] */
    double *a, *b;        /* [K + 1] */
} table_t;

/* the tables of `groups` groups, their arrays in one allocation (`tables_free`) */
static table_t *tables_alloc(int64_t groups, int k) {
    table_t *t = malloc((size_t)groups * sizeof(table_t));
    int64_t per = k + 4 * (int64_t)(k + 1);
    double *store = malloc((size_t)(groups * per) * sizeof(double));
    int *orders = malloc((size_t)(groups * k) * sizeof(int));
    for (int64_t g = 0; g < groups; g++) {
        double *d = store + g * per;
        t[g].k = k;
        t[g].c = d;
        t[g].big_l = d + k;
        t[g].big_r = t[g].big_l + (k + 1);
        t[g].a = t[g].big_r + (k + 1);
        t[g].b = t[g].a + (k + 1);
        t[g].order = orders + g * k;
    }
    return t;
}

static void tables_free(table_t *t) {
    free(t[0].c);
    free(t[0].order);
    free(t);
}

/* e^{-(c_{j-1} - c_k) / tau} / L_j (k < j) */
static inline double left_p(const table_t *t, int j, int k) {
    return exp((t->c[k] - t->c[j - 1]) / t->tau) / t->big_l[j];
}
/* e^{-(c_k - c_j) / tau} / R_j (k >= j) */
static inline double right_q(const table_t *t, int j, int k) {
    return exp((t->c[j] - t->c[k]) / t->tau) / t->big_r[j];
}

static void build_table(table_t *t, const double *slots, int k, double tau) {
    t->k = k;
    t->tau = tau;
    for (int i = 0; i < k; i++) t->order[i] = i;
    for (int i = 1; i < k; i++) { /* insertion sort of the slots by value (stable) */
        int o = t->order[i], at = i;
        while (at > 0 && slots[t->order[at - 1]] > slots[o]) {
            t->order[at] = t->order[at - 1];
            at--;
        }
        t->order[at] = o;
    }
    for (int i = 0; i < k; i++) t->c[i] = slots[t->order[i]];
    for (int j = 0; j <= k; j++) {
        double sl = 0, sr = 0;
        for (int i = 0; i < j; i++) sl += exp((t->c[i] - t->c[j - 1]) / tau);
        for (int i = j; i < k; i++) sr += exp((t->c[j] - t->c[i]) / tau);
        t->big_l[j] = sl;
        t->big_r[j] = sr;
    }
    for (int j = 0; j <= k; j++) {
        double sa = 0, sb = 0;
        for (int i = 0; i < j; i++) sa += left_p(t, j, i) * t->c[i];
        for (int i = j; i < k; i++) sb += right_q(t, j, i) * t->c[i];
        t->a[j] = sa;
        t->b[j] = sb;
    }
}

/* the float constants of the per-point loops (cs padded to 2K with +inf) */
static void fill_consts(const table_t *t, consts_t *f, float *cs, float *m, float *l, float *b, float *d) {
    int k = t->k;
    for (int i = 0; i < 2 * k; i++) cs[i] = i < k ? (float)t->c[i] : INFINITY;
    for (int j = 0; j <= k; j++) {
        int inner = j > 0 && j < k;
        m[j] = inner ? (float)(0.5 * (t->c[j - 1] + t->c[j])) : 0.0f;
        l[j] = inner ? (float)(log(t->big_l[j]) - log(t->big_r[j])) : 0.0f;
        b[j] = (float)t->b[j];
        d[j] = (float)(t->a[j] - t->b[j]);
    }
    f->cs = cs;
    f->m = m;
    f->l = l;
    f->b = b;
    f->d = d;
    f->kappa = (float)(2.0 / t->tau);
    f->k = k;
}

/* den_k, num_k of the k-means step from the per-interval sums s [K + 1][4] */
static void step_terms(const table_t *t, const double *s, double *den, double *num) {
    int k = t->k;
    for (int c = 0; c < k; c++) {
        double dn = 0, nm = 0;
        for (int j = c + 1; j <= k; j++) {
            double p = left_p(t, j, c);
            dn += p * s[4 * j + 1];
            nm += p * s[4 * j + 2];
        }
        for (int j = 0; j <= c; j++) {
            double q = right_q(t, j, c);
            dn += q * (s[4 * j] - s[4 * j + 1]);
            nm += q * (s[4 * j + 3] - s[4 * j + 2]);
        }
        den[c] = dn;
        num[c] = nm;
    }
}

/* d loss / d sorted centroids from the upstream derivatives of the table: dtheta [K + 1] (inner intervals), da, db
 * [K + 1] (of A_j, B_j; NULL: none), and of the step (alpha = d/d num, beta = d/d den [K] with its sums s; NULL:
 * none). P_jk's total derivative is dP_jk = da_j c_k + beta_k Su_j + alpha_k Suv_j (Q likewise); the softmax
 * normalisation and the log L_j - log R_j of theta give d/dc_k = sum_{j>k} [da_j P_jk + phi_jk / tau]
 * + sum_{j<=k} [db_j Q_jk - psi_jk / tau], phi_jk = P_jk (dP_jk - <dP_j, P_j> + dtheta_j),
 * psi_jk = Q_jk (dQ_jk - <dQ_j, Q_j> - dtheta_j) (theta's own c_{j-1} + c_j cancels against the normalisers). */
static void table_backward(const table_t *t, const double *dtheta, const double *da, const double *db,
                           const double *alpha, const double *beta, const double *s, double *dc) {
    int k = t->k;
    double dp[MAXK], p[MAXK];
    for (int c = 0; c < k; c++) dc[c] = 0;
    for (int j = 0; j <= k; j++) {
        double th = (j > 0 && j < k) ? dtheta[j] : 0.0;
        if (j > 0) { /* left: P_jk, k < j */
            double dot = 0;
            for (int c = 0; c < j; c++) {
                p[c] = left_p(t, j, c);
                dp[c] = (da ? da[j] * t->c[c] : 0.0) +
                        (alpha ? beta[c] * s[4 * j + 1] + alpha[c] * s[4 * j + 2] : 0.0);
                dot += dp[c] * p[c];
            }
            for (int c = 0; c < j; c++) dc[c] += (da ? da[j] * p[c] : 0.0) + p[c] * (dp[c] - dot + th) / t->tau;
        }
        if (j < k) { /* right: Q_jk, k >= j */
            double dot = 0;
            for (int c = j; c < k; c++) {
                p[c] = right_q(t, j, c);
                dp[c] = (db ? db[j] * t->c[c] : 0.0) +
                        (alpha ? beta[c] * (s[4 * j] - s[4 * j + 1]) + alpha[c] * (s[4 * j + 3] - s[4 * j + 2]) : 0.0);
                dot += dp[c] * p[c];
            }
            for (int c = j; c < k; c++) dc[c] += (db ? db[j] * p[c] : 0.0) - p[c] * (dp[c] - dot - th) / t->tau;
        }
    }
}

/* ---- the entry points ----------------------------------------------------------------------------------------- */

typedef struct { /* per-group float constants of one stage, for every group */
    consts_t *consts;
    float *store;
} stage_consts_t;

static stage_consts_t alloc_consts(int64_t groups, int k) {
    stage_consts_t s;
    s.consts = calloc((size_t)groups, sizeof(consts_t));
    s.store = calloc((size_t)(groups * (2 * k + 8 * (k + 1))), sizeof(float));
    return s;
}

static void set_consts(stage_consts_t *s, int64_t g, const table_t *t) {
    int k = t->k;
    float *base = s->store + g * (2 * k + 8 * (k + 1));
    float *m = base + 2 * k, *l = m + (k + 1), *b = l + (k + 1), *d = b + (k + 1);
    fill_consts(t, s->consts + g, base, m, l, b, d);
    s->consts[g].lu = d + (k + 1);
    s->consts[g].luv = d + 2 * (k + 1);
    s->consts[g].lv = d + 3 * (k + 1);
}

static void free_consts(stage_consts_t *s) {
    free(s->consts);
    free(s->store);
}

/* Population standard deviation of each group's points (weighted by `mult`), into std [groups]. */
void dkm_group_std(const void *src, int kind, const double *mult, int64_t rows, int64_t cols, int64_t groups,
                   const float *scales, int64_t bs, double *std, int threads) {
    problem_t p = make_problem(src, kind, rows, cols, groups, scales, bs, 1);
    double *part = calloc((size_t)(p.chunks * 3), sizeof(double));
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && p.chunks > 1)
    for (int64_t ch = 0; ch < p.chunks; ch++) {
        int64_t g = ch / p.chunks_per_group;
        int64_t r0 = g * p.per_group + (ch % p.chunks_per_group) * p.chunk_rows;
        int64_t r1 = r0 + p.chunk_rows;
        if (r1 > (g + 1) * p.per_group) r1 = (g + 1) * p.per_group;
        double n = 0, s1 = 0, s2 = 0;
        float v[BLK];
        for (int64_t r = r0; r < r1; r++)
            for (int64_t c = 0; c < cols;) {
                int64_t end = p.bs ? c + p.bs : cols;
                float sc = p.bs ? scales[r * (cols / p.bs) + c / p.bs] : 1.0f;
                while (c < end) {
                    int cnt = end - c < BLK ? (int)(end - c) : BLK;
                    load(src, kind, r * cols + c, sc, cnt, v);
                    for (int i = 0; i < cnt; i++) {
                        double w = mult ? mult[r * cols + c + i] : 1.0;
                        n += w;
                        s1 += w * v[i];
                        s2 += w * (double)v[i] * v[i];
                    }
                    c += cnt;
                }
            }
        part[3 * ch] = n;
        part[3 * ch + 1] = s1;
        part[3 * ch + 2] = s2;
    }
    for (int64_t g = 0; g < groups; g++) {
        double n = 0, s1 = 0, s2 = 0;
        for (int64_t ch = g * p.chunks_per_group; ch < (g + 1) * p.chunks_per_group; ch++) {
            n += part[3 * ch];
            s1 += part[3 * ch + 1];
            s2 += part[3 * ch + 2];
        }
        double mean = n > 0 ? s1 / n : 0, var = n > 0 ? s2 / n - mean * mean : 0;
        std[g] = sqrt(var > 0 ? var : 0);
    }
    free(part);
}

/* DKM forward (imp: each column's importance in the k-means step, NULL: uniform). traj [(iters + 1) * groups * K]: traj[0..] holds the start centroids (slot order) and receives each
 * iteration's; sums [iters * groups * (K + 1) * 4] receives each iteration's sums; tau, eps [groups]. Writes the
 * output o(w / s) * s into out [rows, cols] (rounded to bfloat16 values with round_bf16) when out is not NULL.
 * Returns the number of iterations run. */
int dkm_forward(const void *src, int kind, const double *mult, int64_t rows, int64_t cols, int64_t groups,
                const float *scales, int64_t bs, const float *imp, int k, const double *tau, const double *eps, int iters,
                double *traj, double *sums, float *out, int round_bf16, int threads) {
    problem_t p = make_problem(src, kind, rows, cols, groups, scales, bs, k);
    table_t *tabs = tables_alloc(groups, k);
    stage_consts_t sc = alloc_consts(groups, k);
    io_t io = {mult, NULL, NULL, NULL, NULL, round_bf16, imp};
    int done = 0;
    double den[MAXK], num[MAXK];
    for (int it = 0; it < iters; it++) {
        const double *c = traj + (int64_t)it * groups * k;
        double *next = traj + (int64_t)(it + 1) * groups * k;
        double *s = sums + (int64_t)it * groups * (k + 1) * 4;
        for (int64_t g = 0; g < groups; g++) {
            build_table(tabs + g, c + g * k, k, tau[g]);
            set_consts(&sc, g, tabs + g);
        }
        pass(&p, OP_SUMS, sc.consts, &io, s, threads);
        int moved = 0;
        for (int64_t g = 0; g < groups; g++) {
            const table_t *t = tabs + g;
            step_terms(t, s + g * (k + 1) * 4, den, num);
            for (int i = 0; i < k; i++) {
                double old = t->c[i], now = den[i] > 1e-30 ? num[i] / den[i] : old;
                next[g * k + t->order[i]] = now;
                if (fabs(now - old) > eps[g]) moved = 1;
            }
        }
        done = it + 1;
        if (!moved) break;
    }
    if (out) {
        const double *c = traj + (int64_t)done * groups * k;
        for (int64_t g = 0; g < groups; g++) {
            build_table(tabs + g, c + g * k, k, tau[g]);
            set_consts(&sc, g, tabs + g);
        }
        io.out = out;
        pass(&p, OP_OUT, sc.consts, &io, NULL, threads);
    }
    free_consts(&sc);
    tables_free(tabs);
    return done;
}

/* DKM backward over `done` iterations (traj, sums as the forward left them). The output's gradient is g [rows,
 * cols] (float32, per point), or for unique points gsum [rows, cols] (float64: the sum over the weights each point
 * stands for; then the output's derivative alone is written, to be multiplied by each weight's own gradient later).
 * Writes grad [rows, cols] (d loss / d w, float32), the iterations' part added to grad_steps instead where it is
 * not NULL (for unique points: grad holds the output's derivative, grad_steps the iterations' part; zero it first),
 * and, when out is not NULL, the output again (as the forward wrote it). */
void dkm_backward(const void *src, int kind, const double *mult, int64_t rows, int64_t cols, int64_t groups,
                  const float *scales, int64_t bs, const float *imp, int k, const double *tau, int done, const double *traj,
                  const double *sums, const float *g, const double *gsum, float *grad, float *grad_steps,
                  float *out, int round_bf16, int threads) {
    problem_t p = make_problem(src, kind, rows, cols, groups, scales, bs, k);
    table_t *tabs = tables_alloc(groups, k);
    stage_consts_t sc = alloc_consts(groups, k);
    int64_t width = 4 * (int64_t)(k + 1);
    double *acc = malloc((size_t)(groups * width) * sizeof(double));
    double *gamma = calloc((size_t)(groups * k), sizeof(double)); /* d loss / d centroids, slot order */
    double *alpha = malloc((size_t)(groups * k) * sizeof(double)); /* d loss / d num_k, sorted order */
    double *beta = malloc((size_t)(groups * k) * sizeof(double));  /* d loss / d den_k */
    double dc[MAXK], dth[MAXK + 1], da[MAXK + 1], db[MAXK + 1], den[MAXK], num[MAXK];
    const double *ct = traj + (int64_t)done * groups * k;
    for (int64_t gr = 0; gr < groups; gr++) {
        build_table(tabs + gr, ct + gr * k, k, tau[gr]);
        set_consts(&sc, gr, tabs + gr);
    }
    io_t io = {mult, g, gsum, out, grad, round_bf16, NULL};
    pass(&p, OP_OUT_BWD, sc.consts, &io, acc, threads);
    for (int64_t gr = 0; gr < groups && done > 0; gr++) {
        const table_t *t = tabs + gr;
        const double *a = acc + gr * width;
        for (int j = 0; j <= k; j++) {
            da[j] = a[4 * j];
            db[j] = a[4 * j + 1];
            dth[j] = a[4 * j + 2];
        }
        table_backward(t, dth, da, db, NULL, NULL, NULL, dc);
        for (int i = 0; i < k; i++) gamma[gr * k + t->order[i]] = dc[i];
    }
    for (int it = done - 1; it >= 0; it--) { /* the iterations, last first */
        const double *c = traj + (int64_t)it * groups * k;
        const double *s = sums + (int64_t)it * groups * width;
        for (int64_t gr = 0; gr < groups; gr++) {
            table_t *t = tabs + gr;
            build_table(t, c + gr * k, k, tau[gr]);
            set_consts(&sc, gr, t);
            step_terms(t, s + gr * width, den, num);
            double *al = alpha + gr * k, *be = beta + gr * k;
            for (int i = 0; i < k; i++) { /* c_k = num_k / den_k, or kept where nobody attends it */
                double gm = gamma[gr * k + t->order[i]];
                int live = den[i] > 1e-30;
                al[i] = live ? gm / den[i] : 0.0;
                be[i] = live ? -gm * (num[i] / den[i]) / den[i] : 0.0;
                gamma[gr * k + t->order[i]] = live ? 0.0 : gm;
            }
            float *lu = (float *)sc.consts[gr].lu, *luv = (float *)sc.consts[gr].luv;
            float *lv = (float *)sc.consts[gr].lv;
            for (int j = 0; j <= k; j++) { /* d loss / d (Su_j, Suv_j, Sv_j) */
                double x = 0, y = 0, z = 0;
                for (int i = 0; i < j; i++) {
                    double pp = left_p(t, j, i);
                    x += pp * be[i];
                    y += pp * al[i];
                }
                for (int i = j; i < k; i++) {
                    double q = right_q(t, j, i);
                    x -= q * be[i];
                    y -= q * al[i];
                    z += q * al[i];
                }
                lu[j] = (float)x;
                luv[j] = (float)y;
                lv[j] = (float)z;
            }
        }
        io_t sio = {mult, NULL, NULL, NULL, grad_steps ? grad_steps : grad, 0, imp};
        pass(&p, OP_STEP_BWD, sc.consts, &sio, acc, threads);
        if (it == 0) break; /* the start centroids take no gradient */
        for (int64_t gr = 0; gr < groups; gr++) {
            const table_t *t = tabs + gr;
            const double *a = acc + gr * width;
            for (int j = 0; j <= k; j++) dth[j] = a[4 * j];
            table_backward(t, dth, NULL, NULL, alpha + gr * k, beta + gr * k, s + gr * width, dc);
            for (int i = 0; i < k; i++) gamma[gr * k + t->order[i]] += dc[i];
        }
    }
    free(beta);
    free(alpha);
    free(gamma);
    free(acc);
    free_consts(&sc);
    tables_free(tabs);
}

/* ---- 16-bit weights without scales: the points are the distinct bit patterns of each group ------------------------
 * A group of 16-bit weights holds at most 65,536 distinct values, so the iterations run over those (with their
 * counts as multiplicities) and the weights only take part in a few lookups: counting the patterns, reading each
 * weight's output, summing the output gradient per pattern, and each weight's gradient g J_p + H_p (J_p the output's
 * derivative at the pattern, H_p the iterations' part, the same for every weight of a pattern). */

#define PATTERNS 65536

/* counts [groups * 65536] of the patterns of w [n] (groups equal runs) */
void dkm_pattern_counts(const uint16_t *w, int64_t n, int64_t groups, int32_t *counts, int threads) {
    int64_t per = n / groups;
    memset(counts, 0, (size_t)(groups * PATTERNS) * sizeof(int32_t));
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && groups > 1)
    for (int64_t g = 0; g < groups; g++) {
        int32_t *mine = counts + g * PATTERNS;
        for (int64_t i = g * per; i < (g + 1) * per; i++) mine[w[i]]++;
    }
}

/* out [n] (float32) = table [groups * 65536] at each weight's pattern */
void dkm_pattern_lookup(const uint16_t *w, int64_t n, int64_t groups, const float *table, float *out, int threads) {
    int64_t per = n / groups;
    (void)threads;
    for (int64_t g = 0; g < groups; g++) {
        const float *tab = table + g * PATTERNS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && per > (1 << 16))
        for (int64_t i = g * per; i < (g + 1) * per; i++) out[i] = tab[w[i]];
    }
}

/* gsum [groups * 65536] (float64) = the sum of grad [n] over the weights of each pattern (partial sums per thread,
 * added in thread order) */
void dkm_pattern_grad_sums(const uint16_t *w, const float *grad, int64_t n, int64_t groups, double *gsum,
                           int threads) {
    int64_t per = n / groups;
    int nt = threads > 1 && per > (1 << 18) ? threads : 1;
    double *part = nt > 1 ? calloc((size_t)(nt - 1) * PATTERNS, sizeof(double)) : NULL;
    memset(gsum, 0, (size_t)(groups * PATTERNS) * sizeof(double));
    for (int64_t g = 0; g < groups; g++) {
        double *sum = gsum + g * PATTERNS;
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
#ifdef _OPENMP
            int me = omp_get_thread_num();
#else
            int me = 0;
#endif
            double *mine = me == 0 ? sum : part + (int64_t)(me - 1) * PATTERNS;
#pragma omp for schedule(static)
            for (int64_t i = g * per; i < (g + 1) * per; i++) mine[w[i]] += grad[i];
        }
        for (int t = 1; t < nt; t++) {
            double *other = part + (int64_t)(t - 1) * PATTERNS;
            for (int p = 0; p < PATTERNS; p++) sum[p] += other[p];
            memset(other, 0, PATTERNS * sizeof(double));
        }
    }
    free(part);
}

/* dw [n] = grad * jac[p] + h[p] at each weight's pattern p (as bfloat16 bits with to_bf16, else float32), and
 * out [n] = table[p] when out is not NULL */
void dkm_pattern_apply(const uint16_t *w, const float *grad, int64_t n, int64_t groups, const float *jac,
                       const float *h, const float *table, void *dw, int to_bf16, float *out, int threads) {
    int64_t per = n / groups;
    (void)threads;
    for (int64_t g = 0; g < groups; g++) {
        const float *jg = jac + g * PATTERNS, *hg = h + g * PATTERNS, *tg = table + g * PATTERNS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && per > (1 << 16))
        for (int64_t i = g * per; i < (g + 1) * per; i++) {
            uint16_t p = w[i];
            float x = grad[i] * jg[p] + hg[p];
            if (to_bf16) {
                float r = bf16_round(x);
                uint32_t b;
                memcpy(&b, &r, 4);
                ((uint16_t *)dw)[i] = (uint16_t)(b >> 16);
            } else {
                ((float *)dw)[i] = x;
            }
            if (out) out[i] = tg[p];
        }
    }
}
