// Shared helpers for the ladder's kernels (rungs 0..6). Included by every numbered .cu file;
// NVRTC finds it through -I<this folder>, nvcc likewise (tests/test_cuda_compile.py).
#pragma once

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

// -inf without <math_constants.h> (NVRTC has no system headers)
#define NEG_INF __int_as_float(0xff800000)

// Sum of `v` over the 32 lanes of a warp (every lane gets the total).
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ int warp_sum_i(int v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}
