/* libkernels.so: kernels.cu's fatbin carried the way a CUDA shared library carries it, for the
 * fake-driver tests' `wrapped` mode.
 *
 * nvcc puts a library's fatbin in a section named .nv_fatbin and points a __fatBinC_Wrapper_t
 * (in .nvFatBinSegment) at it; the runtime hands that wrapper to the driver. This library is
 * built by gcc the same way, the fatbin bytes pulled in with the assembler's .incbin (the
 * build runs gcc with -Wa,-I<dir of kernels.fatbin>). Unlike nvcc's, the wrapper is exported,
 * as __fatDeviceText, so that cuda_app can find it with dlsym. */

__asm__(".section .nv_fatbin, \"a\"\n"
        ".balign 8\n"
        "kernels_fatbin:\n"
        ".incbin \"kernels.fatbin\"\n"
        ".previous\n");

extern const unsigned long long kernels_fatbin[];

typedef struct {
    int magic;                     /* 0x466243b1 */
    int version;                   /* 1 */
    const unsigned long long *data; /* the fatbin */
    void *filename_or_fatbins;
} __fatBinC_Wrapper_t;

__attribute__((section(".nvFatBinSegment"), aligned(8), visibility("default")))
const __fatBinC_Wrapper_t __fatDeviceText = {0x466243b1, 1, kernels_fatbin, 0};
