/*
10 SGD update: w[i] -= lr * g[i]   (weights and biases alike; fp32 master weights).

Compile check: nvcc --ptx -arch=sm_90 -I. 10_sgd.cu

version 1 is one thread per element.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per element
// bytes: 12*n (read w and g, write w). FLOPs: 2*n
extern "C" __global__ void sgd_kernel1(float* __restrict__ w, const float* __restrict__ g, float lr, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    w[i] -= lr * g[i];  // W -= lr * dW
}
