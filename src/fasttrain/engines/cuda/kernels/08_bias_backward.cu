/*
08 bias gradient: db[j] = sum_r d[r, j]      (the weight gradient dW = H.T @ D is a matmul: 02 or cuBLAS)

Compile check: nvcc --ptx -arch=sm_90 -I. 08_bias_backward.cu

version 1 is one block per column: its threads stride down the rows, then a warp-shuffle and
shared-memory reduction. (One thread per column looping over the rows would leave a 10-class
layer with 10 threads each waiting on 128 serial loads.)
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one block per column, block-wide reduction over rows
// bytes: 4*rows*cols read + 4*cols written. FLOPs: rows*cols adds
extern "C" __global__ void bias_backward_kernel1(float* __restrict__ db, const float* __restrict__ d,
                                                 int rows, int cols) {
    __shared__ float partial[32];
    int j = blockIdx.x;
    float s = 0.0f;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) s += d[(long long)r * cols + j];
    s = warp_sum(s);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = s;
    __syncthreads();
    if (warp == 0) {
        int n_warps = blockDim.x / 32;
        s = lane < n_warps ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) db[j] = s;  // db = sum_rows(d)
    }
}
