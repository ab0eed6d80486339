/* Shared by the C kernels whose loops come in a portable and an AVX2 + FMA build (`hf_llmkit.native.CLibrary`
 * compiles this file and the kernel's source as one unit): whether the CPU they run on has AVX2 and FMA. */
#if defined(__x86_64__) && defined(__GNUC__)
static int cpu_has_avx2_fma(void) {
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cpu;
}
#else
static int cpu_has_avx2_fma(void) { return 0; }
#endif
