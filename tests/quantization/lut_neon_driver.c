/* A driver of the DKM CPU kernel without Python, for `test_lut_neon.py`: compiled after the kernel's sources (one
 * translation unit, so it reaches the kernel's static `level`) by a cross compiler and run under qemu.
 *
 * usage: lut_neon_driver LEVEL < cases > results   (LEVEL: the cap, as `lut_max_level` takes it)
 * Each case on stdin: 11 little-endian int64 (rows, cols, bits, rows_per_group, nblocks (0: no scales), lut_dtype,
 * scale_dtype, mode, x_dtype, m, y_dtype), then the packed indices, the tables, the scales (if any) and x, each in
 * its dtype. For each, stdout gets the level its product took (int64), y = x @ W^T [m, rows] in y_dtype, and the
 * decoded weight [rows, cols] in the mode's dtype. Exits 1 on a short read or a failed allocation.
 */
#include <stdio.h>

static size_t item_size(int64_t code) { return code == SCALE_F32 ? 4 : 2; }
static size_t out_size(int64_t code) { return code == OUT_F32 ? 4 : 2; }

static void *read_exactly(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p || fread(p, 1, n, stdin) != n) exit(1);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    lut_max_level(atoi(argv[1]));
    int64_t h[11];
    while (fread(h, sizeof(int64_t), 11, stdin) == 11) {
        const int64_t rows = h[0], cols = h[1], bits = h[2], per_group = h[3], nblocks = h[4], m = h[9];
        const int64_t lut_dtype = h[5], scale_dtype = h[6], mode = h[7], x_dtype = h[8], y_dtype = h[10];
        uint8_t *packed = read_exactly((size_t)(rows * cols * bits / 8));
        void *lut = read_exactly((size_t)((rows / per_group) << bits) * item_size(lut_dtype));
        void *scale = nblocks ? read_exactly((size_t)(rows * nblocks) * item_size(scale_dtype)) : 0;
        void *x = read_exactly((size_t)(m * cols) * item_size(x_dtype));
        const weight_args a = {packed, rows, cols, bits, lut, lut_dtype, per_group, scale, scale_dtype, nblocks};
        const weight_t w = make_weight(&a, (int)mode);
        const int64_t taken = level(&w, (int)x_dtype);
        void *y = malloc((size_t)(m * rows) * out_size(y_dtype));
        void *decoded = malloc((size_t)(rows * cols) * out_size(mode));
        if (!y || !decoded || lut_gemv(&a, (int)mode, x, (int)x_dtype, m, y, (int)y_dtype, 1)) return 1;
        lut_decode(&a, (int)mode, decoded, 1);
        fwrite(&taken, sizeof(taken), 1, stdout);
        fwrite(y, out_size(y_dtype), (size_t)(m * rows), stdout);
        fwrite(decoded, out_size(mode), (size_t)(rows * cols), stdout);
        free(packed), free(lut), free(scale), free(x), free(y), free(decoded);
    }
    return 0;
}
