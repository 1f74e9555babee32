/*
06 accuracy: correct[0] += number of rows whose argmax_j z[r, j] equals y_r.
Ties go to the first maximum, like NumPy's argmax in the reference. Reads the logits, not the
probabilities: exp can round two distinct logits to one probability and make a tie that the
reference does not see.
Rungs 0..3; rung 4 fuses it with 05 cross-entropy into 11_loss_accuracy.cu.

Compile check: nvcc --ptx -arch=sm_90 -I. 06_accuracy.cu

version 1 is one thread per row and one atomicAdd per correct row.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per row
// bytes: 4*rows*cols (logits) + 4*rows (labels) + up to rows atomics. FLOPs: rows*cols compares
extern "C" __global__ void accuracy_kernel1(int* __restrict__ correct, const float* __restrict__ z,
                                            const int* __restrict__ y, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* zr = z + (long long)r * cols;
    int best = 0;
    float best_v = zr[0];
    for (int j = 1; j < cols; ++j) {
        if (zr[j] > best_v) { best_v = zr[j]; best = j; }  // strict >: first maximum wins
    }
    if (best == y[r]) atomicAdd(correct, 1);
}
