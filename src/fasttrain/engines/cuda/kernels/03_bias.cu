/*
03 bias: z[r, j] += b[j], then h = relu(z) for hidden layers (relu != 0), in place.

Compile check: nvcc --ptx -arch=sm_90 -I. 03_bias.cu

version 1 is one thread per element.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per element
// bytes: 8*rows*cols (read + write z) + 4*cols (b, cached). FLOPs: rows*cols (+ max)
extern "C" __global__ void bias_forward_kernel1(float* __restrict__ z, const float* __restrict__ b,
                                                int rows, int cols, int relu) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    float v = z[i] + b[i % cols];
    z[i] = relu ? fmaxf(v, 0.0f) : v;  // h = max(z, 0)
}
