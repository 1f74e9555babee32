/*
11 fused loss and accuracy (rung 4 and up): one kernel does the work of 05 and 06,
    loss_steps[slot] += sum_r -log p[r, y_r]
    correct[0]       += #{r : argmax_j z[r, j] == y_r}   (first maximum wins, on the logits)
One launch instead of two, and one atomic pair per warp instead of one atomic per row.

Compile check: nvcc --ptx -arch=sm_90 -I. 11_loss_accuracy.cu

version 1 is one thread per row, warp-shuffle sums, lane 0 of each warp adds to the totals.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per row, reduced per warp
// bytes: 4*rows*cols (logits) + 4*rows (p[y]) + 4*rows (labels) + 2*ceil(rows/32) atomics
// FLOPs: rows*cols compares + rows logf
extern "C" __global__ void loss_accuracy_kernel1(double* __restrict__ loss_steps, int slot, int* __restrict__ correct,
                                                 const float* __restrict__ p, const float* __restrict__ z,
                                                 const int* __restrict__ y, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    double loss = 0.0;
    int ok = 0;
    if (r < rows) {  // no early return: every lane must reach the shuffles
        const float* zr = z + (long long)r * cols;
        int label = y[r];
        int best = 0;
        float best_v = zr[0];
        for (int j = 1; j < cols; ++j) {
            if (zr[j] > best_v) { best_v = zr[j]; best = j; }
        }
        ok = best == label;
        loss = (double)(-logf(p[(long long)r * cols + label]));  // -log softmax(z)[y]
    }
    loss = warp_sum_d(loss);
    ok = warp_sum_i(ok);
    if ((threadIdx.x & 31) == 0) {
        if (loss != 0.0) atomicAdd(loss_steps + slot, loss);
        if (ok) atomicAdd(correct, ok);
    }
}
