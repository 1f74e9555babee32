/*
04 softmax: p[r, :] = exp(z[r, :] - max_j z[r, j]) / sum_j exp(z[r, j] - max)
Rungs 0..4; rung 5 replaces it with cudnnSoftmaxForward (CUDNN_SOFTMAX_ACCURATE, which also
subtracts the row maximum).

Compile check: nvcc --ptx -arch=sm_90 -I. 04_softmax.cu

version 1 is one thread per row: with 10 classes a row is 40 bytes, so a thread's three passes
stay in L1.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per row, three passes (max, exp and sum, normalize)
// bytes: 4*rows*cols read + 4*rows*cols written. FLOPs: ~4*rows*cols plus rows*cols expf
extern "C" __global__ void softmax_forward_kernel1(float* __restrict__ p, const float* __restrict__ z,
                                                   int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* zr = z + (long long)r * cols;
    float* pr = p + (long long)r * cols;
    float m = NEG_INF;
    for (int j = 0; j < cols; ++j) m = fmaxf(m, zr[j]);
    float s = 0.0f;
    for (int j = 0; j < cols; ++j) {
        float e = expf(zr[j] - m);
        pr[j] = e;
        s += e;
    }
    for (int j = 0; j < cols; ++j) pr[j] = pr[j] / s;  // divide like the reference (exp / denom)
}
