/*
01 gather: build a batch from the resident training set by the epoch's order.
    x[r, f] = images[order[start + r], f] / 255      (uint8 pixels -> float, as contract.to_inputs)
    y[r]    = labels[order[start + r]]
The whole uint8 training set lives on the device (47 MB for MNIST), so a step never copies
pixels from the host; only the order (4 bytes per example) travels, once per epoch from rung 1.

Compile check: nvcc --ptx -arch=sm_90 -I. 01_gather.cu

version 1 is one thread per (row, feature): consecutive threads read consecutive pixels of one
image and write consecutive floats, so both sides coalesce.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernel version 1: one thread per element
// bytes: rows*features (uint8 read) + 4*rows*features (write) + 4*rows (order) + 5*rows (labels)
// FLOPs: rows*features (one division each)
extern "C" __global__ void gather_kernel1(float* __restrict__ x, int* __restrict__ y,
                                          const unsigned char* __restrict__ images,
                                          const unsigned char* __restrict__ labels,
                                          const int* __restrict__ order, int start, int rows, int features) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * features) return;
    int r = (int)(i / features);
    int f = (int)(i - (long long)r * features);
    int src = order[start + r];
    // float(pixel) / 255.0f: IEEE division, bit-identical to NumPy's float32 to_inputs
    x[i] = (float)images[(long long)src * features + f] / 255.0f;
    if (f == 0) y[r] = (int)labels[src];
}
