/*
07 softmax + cross-entropy backward: d[r, j] = (p[r, j] - [j == y_r]) / batch
the gradient of the batch-mean loss with respect to the logits.

Compile check: nvcc --ptx -arch=sm_90 -I. 07_softmax_backward.cu

version 1 is one thread per element. It divides by the batch size (not a multiply by its
reciprocal) to round exactly as the reference does.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per element
// bytes: 4*rows*cols read + 4*rows*cols written + 4*rows labels. FLOPs: 2*rows*cols
extern "C" __global__ void softmax_crossentropy_backward_kernel1(float* __restrict__ d, const float* __restrict__ p,
                                                                 const int* __restrict__ y, int rows, int cols,
                                                                 float batch) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    int r = (int)(i / cols);
    int j = (int)(i - (long long)r * cols);
    float v = p[i] - (j == y[r] ? 1.0f : 0.0f);  // dL/dz = p - onehot(y)
    d[i] = v / batch;                            // ... of the mean over the batch
}
