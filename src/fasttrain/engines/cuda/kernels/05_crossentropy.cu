/*
05 cross-entropy: loss_steps[slot] += sum_r -log p[r, y_r]   (a batch's summed loss, in double)
Rungs 0..3; rung 4 fuses it with 06 accuracy into 11_loss_accuracy.cu.
The sum of a step lands in its own slot of a per-epoch buffer: rung 0 copies that slot to the
host after every step, rung 1 and up read the whole buffer once per epoch.

Compile check: nvcc --ptx -arch=sm_90 -I. 05_crossentropy.cu

version 1 is one thread per row and one double atomicAdd per row, as a first program does.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per row, atomicAdd per row
// bytes: 4*rows (labels) + 4*rows (one probability each) + rows atomics. FLOPs: rows logf
extern "C" __global__ void crossentropy_forward_kernel1(double* __restrict__ loss_steps, int slot,
                                                        const float* __restrict__ p, const int* __restrict__ y,
                                                        int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float loss = -logf(p[(long long)r * cols + y[r]]);  // -log softmax(z)[y]
    atomicAdd(loss_steps + slot, (double)loss);
}
