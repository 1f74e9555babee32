/*
02 matmul: C[M, N] = A[M, K] @ B[K, N] in fp32, all row-major in memory, with A and B read
through strides so that one kernel does the three products of a layer:
    forward   Z  = H  @ W      A = H  (a_rs=K, a_cs=1),  B = W   (b_rs=N, b_cs=1)
    weights   dW = H.T @ D     A = H.T(a_rs=1, a_cs=M),  B = D   (b_rs=N, b_cs=1)
    inputs    dH = D  @ W.T    A = D  (a_rs=K, a_cs=1),  B = W.T (b_rs=1, b_cs=K)
Rungs 0 and 1 use it; rung 2 replaces every call with cuBLAS sgemm.

Compile check: nvcc --ptx -arch=sm_90 -I. 02_matmul.cu

version 1 is the textbook first kernel: a 2-D grid of 16x16 blocks, one thread per output
element, a K-long dot product straight from global memory (no tiling, no shared memory).
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: naive, 2-D grid of 2-D blocks, one thread per C[row, col]
// FLOPs: 2*M*N*K. bytes: 4*M*N written; reads 4*2*M*N*K without reuse (caches catch most of it)
extern "C" __global__ void matmul_kernel1(float* __restrict__ C, const float* __restrict__ A,
                                          const float* __restrict__ B, int M, int N, int K,
                                          int a_rs, int a_cs, int b_rs, int b_cs) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    const float* a = A + (long long)row * a_rs;
    const float* b = B + (long long)col * b_cs;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += a[(long long)k * a_cs] * b[(long long)k * b_rs];  // C = sum_k A(row,k) B(k,col)
    C[(long long)row * N + col] = acc;
}
