/* SwiGLU's elementwise work for the MoE experts on the CPU (float32), one pass over memory each way.
 *
 * h[rows, 2I] holds each row's gate pre-activation g (columns [0, I)) and up projection u (columns [I, 2I)).
 *   forward:  hidden = act * u,  act = silu(g) = g / (1 + exp(-g))
 *   backward: from da = d loss / d hidden,  dh = [da * u * silu'(g) | da * act],
 *             silu'(g) = s * (1 + g * (1 - s)),  s = 1 / (1 + exp(-g)),  and hidden again
 * torch runs these as two ops forward and three backward, each a pass over [rows, I] tensors that do not fit in the
 * cache, and keeps act and hidden from forward to backward; here each direction reads its inputs once and writes its
 * outputs once, and backward recomputes act and hidden from h (the exp it needs anyway) instead of reading them.
 * exp is Cephes' expf (range reduction to |r| <= ln2 / 2, a degree-7 polynomial, 2^n through the exponent bits);
 * tests/parallel/test_swiglu_kernel.py holds both directions to torch's ops within float32 rounding. Beyond
 * |x| > 87 the argument is clamped (silu is then g or a denormal, as torch's is); NaN stays NaN.
 * The same loops are compiled twice, for AVX2 with FMA (chosen at run time) and portably; the compiler vectorizes
 * them. Rows are shared among OpenMP threads when built with it.
 */
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float exp_f32(float x) {
    x = x > 88.0f ? 88.0f : x; /* a NaN fails both tests and stays NaN */
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)(n == n ? n : 0.0f) + 127) << 23; /* 2^n, n in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline __attribute__((always_inline)) void forward_row(const float *restrict g, const float *restrict u,
                                                               float *restrict hidden, int64_t inter) {
    for (int64_t i = 0; i < inter; i++) hidden[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
}

static inline __attribute__((always_inline)) void backward_row(const float *restrict g, const float *restrict u,
                                                                const float *restrict da, float *restrict dg,
                                                                float *restrict du, float *restrict hidden,
                                                                int64_t inter) {
    for (int64_t i = 0; i < inter; i++) {
        float e = 1.0f + exp_f32(-g[i]);
        float s = 1.0f / e, act = g[i] / e;
        hidden[i] = act * u[i];
        du[i] = da[i] * act;
        dg[i] = (da[i] * u[i]) * (s * (1.0f + g[i] * (1.0f - s)));
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86 1
__attribute__((target("avx2,fma"))) static void forward_avx2(const float *g, const float *u, float *hidden,
                                                              int64_t inter) {
    forward_row(g, u, hidden, inter);
}
__attribute__((target("avx2,fma"))) static void backward_avx2(const float *g, const float *u, const float *da,
                                                               float *dg, float *du, float *hidden, int64_t inter) {
    backward_row(g, u, da, dg, du, hidden, inter);
}
#endif

static void forward_portable(const float *g, const float *u, float *hidden, int64_t inter) {
    forward_row(g, u, hidden, inter);
}
static void backward_portable(const float *g, const float *u, const float *da, float *dg, float *du, float *hidden,
                              int64_t inter) {
    backward_row(g, u, da, dg, du, hidden, inter);
}

static int max_level = 1; /* swiglu_max_level(0) keeps the portable loops (tests compare them) */

void swiglu_max_level(int level) { max_level = level; }

/* 1: the AVX2 loops serve on this CPU, 0: the portable ones. */
int swiglu_level(void) { return max_level >= 1 && cpu_has_avx2_fma(); }

/* hidden [rows, inter] from h [rows, 2 * inter] (rows `ldh` floats apart). */
void swiglu_forward(const float *h, int64_t rows, int64_t inter, int64_t ldh, float *hidden, int threads) {
    int avx2 = swiglu_level();
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = h + r * ldh;
#ifdef HAVE_X86
        if (avx2) {
            forward_avx2(g, g + inter, hidden + r * inter, inter);
            continue;
        }
#endif
        (void)avx2;
        forward_portable(g, g + inter, hidden + r * inter, inter);
    }
}

/* dh [rows, 2 * inter] and hidden [rows, inter] again from h [rows, 2 * inter] (rows `ldh` floats apart) and
 * da [rows, inter]. */
void swiglu_backward(const float *h, const float *da, int64_t rows, int64_t inter, int64_t ldh, float *dh,
                     float *hidden, int threads) {
    int avx2 = swiglu_level();
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = h + r * ldh;
        float *dg = dh + r * 2 * inter;
#ifdef HAVE_X86
        if (avx2) {
            backward_avx2(g, g + inter, da + r * inter, dg, dg + inter, hidden + r * inter, inter);
            continue;
        }
#endif
        (void)avx2;
        backward_portable(g, g + inter, da + r * inter, dg, dg + inter, hidden + r * inter, inter);
    }
}
