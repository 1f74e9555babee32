/*
09 relu backward: d[i] = h[i] > 0 ? d[i] : 0     (relu'(z) = [z > 0] = [h > 0]), in place.

Compile check: nvcc --ptx -arch=sm_90 -I. 09_relu_backward.cu

version 1 is one thread per element.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per element
// bytes: 12*n (read d and h, write d). FLOPs: n compares
extern "C" __global__ void relu_backward_kernel1(float* __restrict__ d, const float* __restrict__ h, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (!(h[i] > 0.0f)) d[i] = 0.0f;
}
