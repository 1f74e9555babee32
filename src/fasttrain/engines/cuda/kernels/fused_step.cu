// fused_step.cu: rung 7, fused tensor-core training step for any MLP (and logreg), captured in a CUDA graph.
//
// Version history (this file is the last; the earlier ones live in dev/cuda/ beside NOTES-fused.md,
// which has the prediction and the measured outcome of each):
//   v1  Per step: ft_gather (batch rows -> fp16/bf16), one ft_fwd per hidden layer (GEMM + bias + ReLU,
//       K split over 8 warps), ft_fwd_last (last GEMM split over blocks, the last block to finish does
//       bias + softmax + loss + accuracy + g = p - onehot), one ft_bwd per layer (the weight-gradient GEMM
//       with the SGD update fused: W^T is read once, dH_in = g @ W (old W) and W -= lr dW computed from the
//       same registers, dW never written; ReLU mask fused into the dH epilogue). fp32 master W^T is the only
//       weight copy: the forward converts it to fp16/bf16 on the fly, so each step moves 12 bytes/parameter
//       (read fwd 4 + read bwd 4 + write 4): that is the floor for fp32 master weights.
//       Measured (H200): mlp:8192x3 2.96 s a run (0.59 ms a step, ~67% of the copy bandwidth); ncu on the
//       8192x8192 ft_bwd: 2.58 TB/s, 170 registers, one block of 8 warps an SM (occupancy 12.5%).
//   v2  ft_bwd software-pipelined in registers (226 registers, slower); not built on here.
//   v3  (copy of v1 + change) Bytes in flight no longer bounded by registers. ft_bwd: each warp streams its
//       16-row chunks of W^T (fp32) and g^T through a private ring of FT_S shared-memory stages filled by
//       16-byte cp.async (FT_S - 1 chunks in flight while one computes; no block barrier in the loop; BI 64,
//       S 4: 96 KB in flight an SM against v1's <= 32 KB); both A fragments (g^T and g) come from the one
//       staged g^T chunk by ldmatrix / ldmatrix.trans (the row-major g is not read), the H_in B fragments by
//       ldmatrix from shared memory where used, W one 8-column tile at a time (registers: BI 64 160, BI 32
//       90; with 2 / 3 blocks an SM forced, BI 64 / BI 32 fit 128 / 80 with no spills); the epilogue's
//       reduction buffer reuses the ring. A second grid dimension splits the output rows over blocks when no
//       dH is needed (the first layer: its 784 / 16 = 49 strips alone would leave most SMs idle). ft_fwd:
//       FT_FU k-steps of W loaded before their mma (BO 64, FU 4: 16 KB a warp, 230 registers). Both kernels
//       carry __launch_bounds__(256, FT_MINB / FT_FMINB), so the host picks the blocks per SM.
//       Measured (H200, dev/cuda/step_breakdown.py): the 8192x8192 ft_bwd 155 us = 3.45 TB/s (read + write),
//       but ft_fwd 140 us = 1.92 TB/s (ncu: 40% of DRAM peak, 230 registers, warps stalled on the loads of
//       each FU group: nothing is in flight while a group's mma run).
//   v4  (copy of v3 + change) ft_fwd streams W^T and H_in through per-warp rings as ft_bwd does: a stage
//       holds one k-step (16 inputs) of the block's BO rows of W^T (fp32) and of H_in, filled by 16-byte
//       cp.async; FT_FU stages in flight while one computes (BO 64: 4 x 5 KB a warp, 160 KB an SM). Each warp
//       keeps v3's k-steps (warp, warp + 8, ...) in the same order and the same reduction, so the sums and
//       their rounding are v3's: v4 is bit-identical to v3 (and v1).
//       Measured (H200): bit-identical to v3 on every model tried; the 8192x8192 ft_fwd 141 -> 93 us (2.9 TB/s),
//       mlp:8192x3 3.30 -> 2.80 s, mlp:4096x3 1.11 -> 0.96 s, mlp:2048x3 0.417 -> 0.405 s.
//   v5  (dev/cuda/fused_step_v5.cu) ft_fwd reading 256-byte runs of each W^T row through one ring shared by the
//       block (a barrier a stage; no K-split at BO 64), to test whether the 64-byte runs limit v4: slower
//       everywhere (8192x8192 ft_fwd 100 us, 4096 39 us, 2048 16.5 us against v4's 93 / 29 / 10). Not the runs.
//   v6  v4 + programmatic dependent launch (the host launches every kernel with the programmatic-stream-
//       serialization attribute, fused/launch.py): each kernel first waits (griddepcontrol.wait) for its
//       predecessor, then lets its successor launch (griddepcontrol.launch_dependents), so a kernel's launch
//       and block scheduling overlap the drain of the one before. The sums are v4's (bit-identical).
//       Measured (H200, dev/cuda/step_breakdown.py --pdl, same machine): a first cut that also prefetched each
//       warp's first W^T rows into L2 before the wait was slower than v4 at 2048-8192 (the prefetches alone,
//       without PDL: +5% at 2048, +7% at 4096, +2% at 8192); dropped.
//   v7  (copy of v6 + change) The hidden layers split over thread-block clusters, partial sums reduced through
//       distributed shared memory: at 2048-4096 every block of v6 re-read all of H_in (forward) or g^T
//       (backward) from L2, as many bytes as its weights at 2048. ft_fwd: gridDim.y blocks of one cluster split
//       the k-steps of the same BO outputs (so a tile of outputs reads H_in once, and BO can stay 64 at any
//       width); ft_bwd: gridDim.y blocks of one cluster split the output rows of one wide strip (BI 64: 256-byte
//       runs of W^T, g^T read once a cluster). Each block reduces its warps' partials into its own shared
//       memory; after a cluster barrier, block r sums column slice r of every block's partial (ranks in order,
//       so the result is deterministic) and writes it. gridDim.y = 1 is v6, sum for sum.
//       Measured (H200, dev/cuda/step_breakdown.py --clusters / --v7): clusters of 2 (the plan's default where
//       they double a hidden layer's tile) take the 2048 step 81 -> 73.5 us and 4096 188 -> 181 us; clusters of 4
//       or 8 are slower (only 30 / 15 of them are resident at one block an SM: two or three waves).
//       Tried and dropped (dev/cuda/fused_step_v7_lastfused.cu): the last layer's forward, softmax and backward
//       in one cluster kernel (ft_last), bit-identical but slower than the two kernels at every width.
//   v8  (copy of v7 + change, dev/cuda/fused_step_v7.cu is v7) Fewer serial waits on memory a step, the same sums:
//       (a) the gather is folded into the first layer: ft_fwd_x and ft_bwd_x read the batch's pixels through the
//       epoch order themselves (x = pixel/255, the gather's arithmetic), and ft_fwd_x writes the labels, so a step
//       of an MLP is 2L kernels; (b) with programmatic dependent launch a kernel may start while its predecessor
//       drains, so what the predecessor does not write is loaded before griddepcontrol.wait: the W^T of ft_fwd
//       (layers 2..L; the first layer's W^T is what the previous step's last kernel writes, so ft_fwd_x loads its
//       pixels early instead) and of ft_bwd, and ft_bwd_x's pixel strip; (c) ft_bwd stages its H_in strip by
//       cp.async in the ring's first group instead of a load round trip after the bias update; ft_fwd_last loads
//       its first two k-steps of W^T before the wait; (d) mid-epoch, the first layer's backward of step k and its
//       forward of step k+1 are one kernel (ft_bwd_fwd_x: a block updates BO rows of W^T in shared memory and
//       computes the next batch's outputs from them), so the first layer's W^T is read once a step, not twice.
//       v8 is bit-identical to v7 (and, without splits, to v3).
//       Measured (H200, dev/cuda/step_breakdown.py --v8, same machine): the step at 2048 73.8 -> 59.9 us, 4096
//       181.7 -> 155.9 us, 8192 560 -> 552 us; the early loads are the larger part (2048: -9.7 us without (d)), the
//       fused first layer 12.8 -> 8.3 us at 2048. mlp:2048x3 runs 1.54x faster than the JAX engine (was 1.32x).
//   v9  v8 + the hidden-to-hidden layers' W^T stored tiled (w_at; the host tiles and untiles, plans.tile_master):
//       tiles of BO rows x 16 inputs, each contiguous, so a forward k-step of a block reads one run of BO * 64 bytes
//       where row-major it read BO runs of 64 bytes 4 * in_p bytes apart, and a backward chunk reads BI / 16 runs of
//       1 KB instead of 16 runs of BI * 4 bytes. Only addresses change (ft_fwd_t / ft_bwd_t): bit-identical to v8.
//       Measured (H200, dev/cuda/step_breakdown.py --v9, same machine): the 8192x8192 forward 90 -> 65 us (2.98 ->
//       4.11 TB/s), the 4096x4096 forward 24.2 -> 21.1 us; the backward unchanged (3.2-3.5 TB/s read + write);
//       the step at 8192 549.6 -> 502.3 us, 4096 158.1 -> 150.6 us, 2048 60.2 -> 58.1 us.
//
// Layout: W^T [out_p][in_p] fp32 row-major (p = padded to 16; padding rows/columns are zero and stay zero; v9: the
// hidden-to-hidden layers' tiled, see w_at),
// activations H [B_p][w_p] in the operand type, g / dZ in both [B_p][w_p] and transposed [w_p][B_p] layouts.
// g is kept unscaled (softmax - onehot, |g| <= 1) and every backward value is B' times the true gradient;
// the 1/B' goes into the update scale (lr / B'), which keeps fp16 away from underflow.
//
// Compile-time configuration (-D): FT_MT m-tiles of the batch (B_p = 16*FT_MT), FT_BO outputs per ft_fwd
// block, FT_BI input features per ft_bwd block (multiples of 8), FT_BF16; v3: FT_S ring stages of ft_bwd (>= 2),
// FT_MINB / FT_FMINB minimum blocks per SM of ft_bwd / ft_fwd (__launch_bounds__), FT_FU k-steps of W (and
// H_in) that ft_fwd keeps in flight a warp (its ring has FT_FU + 1 stages). The cluster splits (v7) are not
// compiled in: gridDim.y of a launch is its cluster. v8: FT_EARLY=0 waits for the previous kernel before loading
// anything (v7's order; kept to measure (b)), 1 (default) loads what it does not write first.
// Compile alone: nvcc --ptx -arch=sm_90a fused_step.cu (the defaults below: batch 32, 64-wide tiles, fp16)
#ifndef FT_MT
#define FT_MT 2
#endif
#ifndef FT_BO
#define FT_BO 64
#endif
#ifndef FT_BI
#define FT_BI 64
#endif
#ifndef FT_BF16
#define FT_BF16 0
#endif
#ifndef FT_S
#define FT_S 4
#endif
#ifndef FT_MINB
#define FT_MINB 1
#endif
#ifndef FT_FMINB
#define FT_FMINB 1
#endif
#ifndef FT_FU
#define FT_FU 2
#endif
#ifndef FT_EARLY
#define FT_EARLY 1
#endif
#include "fused_common.cuh"

#define MT FT_MT
#define BP (MT * 16)
#define NW 8
#define BO FT_BO
#define NB (BO / 8)
#define BI FT_BI
#define NJ (BI / 8)

static_assert(FT_S >= 2, "ft_bwd's ring needs at least two stages");
static_assert(BI % 8 == 0 && BO % 8 == 0, "tiles are multiples of 8 columns");

// ft_bwd's per-warp ring: a stage holds one 16-row chunk of W^T[:, strip] (fp32, row stride WS floats) and
// the chunk's g^T rows (row stride GS elements). Strides chosen so the reads are free of bank conflicts:
//   W: float2 reads, a half-warp = 4 rows x 32 B; a row stride = 32 or 96 (mod 128) bytes puts the 4 rows
//      on disjoint banks (BI = 8: 32 B, no padding; else BI*4 + 32 B).
//   g^T: ldmatrix reads 8 rows x 16 B; a row stride of an odd multiple of 16 B ((BP + 8) * 2 = 32 MT + 16)
//      puts the 8 rows on disjoint 16-byte bank groups.
#define WS (BI == 8 ? 8 : BI + 8)
#define GS (BP + 8)
#define STAGE_BYTES (16 * WS * 4 + 16 * GS * 2)
#define HS_BYTES (BP * (BI + 8) * 2)
#define RING_BYTES (NW * FT_S * STAGE_BYTES)
#define RED_BYTES (NW * BP * (BI + 1) * 4)

// ft_fwd's per-warp ring: a stage holds one k-step of the block's W^T rows (BO x 16 fp32, row stride 64 B:
// a quarter-warp's float4 reads cover 2 rows = 128 contiguous bytes) and of H_in (BP x 16, row stride 32 B:
// a half-warp's 8-byte reads cover 4 rows = 128 bytes); both conflict-free. After the loop the rings become
// the K-split reduction buffer [NW][BP][BO+1] fp32.
#define FSTAGE_W (BO * 16 * 4)
#define FSTAGE (FSTAGE_W + BP * 16 * 2)
#define FRING_BYTES (NW * (FT_FU + 1) * FSTAGE)
#define FRED_BYTES (NW * BP * (BO + 1) * 4)
// v7: each block's reduced partial [BP][BO] (ft_fwd) or [BP][BI] (ft_bwd) fp32, read by the cluster's blocks
#define FRING_RED (FRING_BYTES > FRED_BYTES ? FRING_BYTES : FRED_BYTES)
#define FPART_BYTES (BP * BO * 4)
#define RING_RED (RING_BYTES > RED_BYTES ? RING_BYTES : RED_BYTES)
#define BPART_BYTES (BP * BI * 4)

// dynamic shared memory each kernel needs (read by the host through these symbols)
extern "C" __constant__ int ft_fwd_smem = FRING_RED + FPART_BYTES;
extern "C" __constant__ int ft_last_smem = NW * BP * 17 * 4 + 64;
// H_in strip, then the ring (reused as the dH reduction buffer [NW][BP][BI+1] fp32 after the loop), then the
// block's dH partial
extern "C" __constant__ int ft_bwd_smem = HS_BYTES + RING_RED + BPART_BYTES;

__device__ __forceinline__ elem_t to_elem(float v) {
#if FT_BF16
    return __float2bfloat16_rn(v);
#else
    return __float2half_rn(v);
#endif
}
__device__ __forceinline__ float from_elem(elem_t v) {
#if FT_BF16
    return __bfloat162float(v);
#else
    return __half2float(v);
#endif
}

// v7: sum over the n <= 8 blocks of the cluster, in rank order, of the float at shared address `a` in each:
// 0 + v_0 + v_1 + ... The loads are all issued before the first add, so they overlap.
__device__ __forceinline__ float cluster_sum(u32 a, int n) {
    float v[8];
#pragma unroll
    for (int y = 0; y < 8; ++y) v[y] = y < n ? ld_cluster_f32(mapa(a, y)) : 0.f;
    float s = 0.f;
#pragma unroll
    for (int y = 0; y < 8; ++y) if (y < n) s += v[y];
    return s;
}

#define INPUT_BYTES 784   // a row of pixels (uint8); in_p of the first layer

// Four pixels (the bytes of v, in memory order) -> x = pixel/255 as two packed pairs of the operand type. The one
// conversion of every kernel that reads pixels (ft_gather, and v8's first-layer kernels), so they agree bit for bit.
__device__ __forceinline__ void pixels4(u32 v, u32& lo, u32& hi) {
    const float s = 1.0f / 255.0f;
    lo = pack2((float)(v & 0xff) * s, (float)((v >> 8) & 0xff) * s);
    hi = pack2((float)((v >> 16) & 0xff) * s, (float)(v >> 24) * s);
}

// Eight pixels (v.x, then v.y) -> eight packed elements of x = pixel/255, in memory order
__device__ __forceinline__ uint4 pixels8(uint2 v) {
    uint4 e;
    pixels4(v.x, e.x, e.y);
    pixels4(v.y, e.z, e.w);
    return e;
}

// v9: where element (o, i) of W^T lives. Row-major (TILED false): o * in_p + i. Tiled (the hidden-to-hidden layers):
// tiles of BO rows x 16 inputs, each BO * 64 contiguous bytes (row-major inside: 64 B a row), the tiles of a band of
// BO rows in input order, so that a forward k-step of a block (its BO rows x 16 inputs) is one contiguous run of
// BO * 64 bytes and a backward chunk (16 rows x BI inputs) is BI / 16 runs of 1 KB, where row-major they are BO runs
// of 64 B and 16 runs of BI * 4 B, one a row of in_p * 4 bytes.
template <bool TILED>
__device__ __forceinline__ size_t w_at(int o, int i, int in_p)
{
    if constexpr (TILED) return ((size_t)(o / BO) * (in_p >> 4) + (i >> 4)) * (BO * 16) + (o % BO) * 16 + (i & 15);
    else return (size_t)o * in_p + i;
}

// Batch rows -> x = pixel/255 in the operand type; rows >= rows are zero. grid = B_p blocks of 64 threads.
// Bytes: 784 read + 1568 written per row.
extern "C" __global__ void __launch_bounds__(64)
ft_gather(const u8* __restrict__ X, const int* __restrict__ Y, const int* __restrict__ order, int base, int rows,
          elem_t* __restrict__ xb, int* __restrict__ yb)
{
    // v6: the previous kernel (the last step's first-layer backward) still reads xb: wait before writing it
    grid_dependency_wait();
    launch_dependents();
    const int r = blockIdx.x;
    const int c = threadIdx.x;   // 16-byte chunk, 49 per row
    const int idx = (r < rows) ? order[base + r] : -1;
    if (c == 0) yb[r] = (idx >= 0) ? Y[idx] : 0;
    if (c >= 49) return;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (idx >= 0) v = *reinterpret_cast<const uint4*>(X + (size_t)idx * INPUT_BYTES + c * 16);
    uint4* d = reinterpret_cast<uint4*>(xb + (size_t)r * INPUT_BYTES + c * 16);
    d[0] = pixels8(make_uint2(v.x, v.y));
    d[1] = pixels8(make_uint2(v.z, v.w));
}

// The W^T fragments of k-step ks (n = outputs o0 + nb*8 + g) and their mma with H's (the previous kernel's output).
// The k order inside a 16-step is permuted identically for A and B (thread t holds actual k 4t..4t+3 at
// fragment positions 2t,2t+1,2t+8,2t+9), so each thread reads 16 contiguous bytes of W and 8 of H.
template <int NBT>
__device__ __forceinline__ void w_frags(u32 b[NBT][2], const float* __restrict__ wt, int in_p, int o0, int ks)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nb = 0; nb < NBT; ++nb) {
        const float4 w = __ldg(reinterpret_cast<const float4*>(wt + (size_t)(o0 + nb * 8 + g) * in_p + ks * 16 + 4 * t));
        b[nb][0] = pack2(w.x, w.y);
        b[nb][1] = pack2(w.z, w.w);
    }
}
template <int NBT>
__device__ __forceinline__ void mma_kstep(float acc[MT][NBT][4], const elem_t* __restrict__ h, int in_p, int ks,
                                          const u32 b[NBT][2])
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int k0 = ks * 16 + 4 * t;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const uint2 h0 = *reinterpret_cast<const uint2*>(h + (size_t)(mt * 16 + g) * in_p + k0);
        const uint2 h1 = *reinterpret_cast<const uint2*>(h + (size_t)(mt * 16 + g + 8) * in_p + k0);
        const u32 a[4] = {h0.x, h1.x, h0.y, h1.y};
#pragma unroll
        for (int nb = 0; nb < NBT; ++nb) mma16816(acc[mt][nb], a, b[nb][0], b[nb][1]);
    }
}

// acc[mt][nb] += H[:, k-range] @ W^T[o0 + nb*8 .., k-range]^T over k-steps ks0, ks0+kstride, ... < ks1.
template <int NBT>
__device__ __forceinline__ void gemm_rows(float acc[MT][NBT][4], const elem_t* __restrict__ h, int in_p,
                                          const float* __restrict__ wt, int o0, int ks0, int ks1, int kstride)
{
#pragma unroll 2
    for (int ks = ks0; ks < ks1; ks += kstride) {
        u32 b[NBT][2];
        w_frags<NBT>(b, wt, in_p, o0, ks);
        mma_kstep<NBT>(acc, h, in_p, ks, b);
    }
}

// The A fragment (batch rows mt*16 + g and + 8, inputs 4t..4t+3 of a k-step) of x = pixel/255, from pixels staged in
// shared memory at `x` (the k-step's first column, rows `stride` bytes apart): the gather's conversion (pixels4).
__device__ __forceinline__ void pixel_frag(const u8* x, int stride, int mt, u32 a[4])
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint2 h0, h1;
    pixels4(*reinterpret_cast<const u32*>(x + (mt * 16 + g) * stride + 4 * t), h0.x, h0.y);
    pixels4(*reinterpret_cast<const u32*>(x + (mt * 16 + g + 8) * stride + 4 * t), h1.x, h1.y);
    a[0] = h0.x; a[1] = h1.x; a[2] = h0.y; a[3] = h1.y;
}

// The forward's K-split partials: each warp's accumulators (mma16816's D layout) into red [NW][BP][BO+1] ...
__device__ __forceinline__ void store_warp_partials(float* red, const float acc[MT][NB][4])
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(warp * BP + mt * 16 + g + (e >> 1) * 8) * (BO + 1) + nb * 8 + 2 * t + (e & 1)] = acc[mt][nb][e];
}

// ... and (after a barrier) H_out[:, o0 .. o0 + BO) = relu(b + red_0 + red_1 + ... + red_7), the warps in order
__device__ __forceinline__ void bias_relu_out(const float* red, const float* __restrict__ bias, elem_t* __restrict__ hout,
                                              int o0, int out_p)
{
    for (int i = threadIdx.x; i < BP * BO; i += blockDim.x) {
        const int r = i / BO, c = i % BO;
        float z = bias[o0 + c];
#pragma unroll
        for (int w = 0; w < NW; ++w) z += red[(w * BP + r) * (BO + 1) + c];
        hout[(size_t)r * out_p + o0 + c] = to_elem(fmaxf(z, 0.f));
    }
}

// H_out = relu(H_in @ W + b) for BO outputs per block; the 8 warps split K and reduce through shared memory.
// Per block: BO*in_p*4 bytes of W (read once per step), B_p*in_p*2 bytes of H_in (from L2); 2*B_p*BO*in_p FLOP.
// v4: warp w takes the k-steps w, w + 8, ... (v3's), streamed through its ring of FT_FU + 1 stages (16-byte
// cp.async, L2 only); FT_FU k-steps stay in flight while one computes, so the loads never drain.
// v7: grid (out_p / BO, C), launched as clusters of (1, C, 1): block y takes the k-steps [kb, ke) of its slice,
// each block reads only its slice of H_in and W^T rows, and the cluster sums the C partials:
//   z[r][o] = b[o] + sum_{y < C} part_y[r][o],  part_y = sum_{w < 8} (warp w's k-steps of slice y)
// v8, PIX (ft_fwd_x, the first layer): H_in is the batch's pixels, read through the epoch order (row r of the
// batch is X[order[base + r]], zero for r >= rows) as 16 bytes a row a k-step and converted where the fragments
// are built; block (0, 0) also writes the labels yb. EARLY: the first FT_FU k-steps' part that the previous
// kernel does not write (W^T of a hidden layer; the pixels of the first layer, whose W^T the previous step's
// last kernel writes) is one commit group issued before griddepcontrol.wait.
template <bool PIX, bool TILED>
__device__ __forceinline__ void fwd_body(const elem_t* __restrict__ hin, int in_p, const float* __restrict__ wt,
                                         const float* __restrict__ bias, elem_t* __restrict__ hout, int out_p,
                                         const u8* __restrict__ X, const int* __restrict__ Y,
                                         const int* __restrict__ order, int base, int rows, int* __restrict__ yb)
{
    constexpr int FS = FT_FU + 1;
    constexpr bool early = FT_EARLY != 0;
    constexpr int RPL = (BP + 31) / 32;   // PIX: batch rows a lane copies (rows lane, lane + 32, ...)
    extern __shared__ __align__(16) unsigned char fsm[];
    float* red = reinterpret_cast<float*>(fsm);   // [NW][BP][BO+1], after the loop
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    unsigned char* ring = fsm + warp * (FS * FSTAGE);
    const int o0 = blockIdx.x * BO;
    const int kt = in_p / 16;
    const int kper = (kt + gridDim.y - 1) / gridDim.y;   // v7: this block's k-steps [kb, ke)
    const int kb = min(kt, (int)blockIdx.y * kper), ke = min(kt, kb + kper);
    const int nk = ke - kb > warp ? (ke - kb - warp + NW - 1) / NW : 0;
    int xrow[RPL];                        // PIX: the pixel row of batch rows lane + 32 j (-1: padding)
    if constexpr (PIX) {
#pragma unroll
        for (int j = 0; j < RPL; ++j) {
            const int r = lane + 32 * j;
            xrow[j] = (r < rows) ? order[base + r] : -1;   // the epoch order is not written by any kernel
        }
    }

    // k-step k of this warp (inputs (kb + warp + k*NW)*16 ..) -> stage k % FS
    auto issue_w = [&](int k) {          // BO rows x 4 pieces of W^T
        if (k >= nk) return;
        const int k0 = (kb + warp + k * NW) * 16;
        const u32 st = smem_u32(ring + (k % FS) * FSTAGE);
#pragma unroll
        for (int p = lane; p < BO * 4; p += 32) {
            const int r = p >> 2, c = p & 3;
            cp_async16(st + (r * 16 + c * 4) * 4, wt + w_at<TILED>(o0 + r, k0 + c * 4, in_p));
        }
    };
    auto issue_h = [&](int k) {
        if (k >= nk) return;
        const int k0 = (kb + warp + k * NW) * 16;
        const u32 st = smem_u32(ring + (k % FS) * FSTAGE) + FSTAGE_W;
        if constexpr (PIX) {             // BP rows x 16 pixels (16 bytes)
#pragma unroll
            for (int j = 0; j < RPL; ++j) {
                const int r = lane + 32 * j;
                if (r < BP) cp_async16_zfill(st + r * 16, X + (size_t)max(xrow[j], 0) * INPUT_BYTES + k0, xrow[j] >= 0);
            }
        } else {                         // BP rows x 2 pieces of H_in
#pragma unroll
            for (int p = lane; p < BP * 2; p += 32) {
                const int r = p >> 1, c = p & 1;
                cp_async16(st + (r * 16 + c * 8) * 2, hin + (size_t)r * in_p + k0 + c * 8);
            }
        }
    };
    // One commit group per k-step (empty past the end, so that the group count stays uniform), and with EARLY
    // one more, oldest, group: the early part of k-steps 0 .. FS-2. cp_async_wait<FS - 1> in the loop then still
    // leaves k-step k complete: after the refill of k-step k + FS - 1, k + 2 (EARLY) or k + 1 groups are done.
    if constexpr (early) {
#pragma unroll
        for (int k = 0; k < FS - 1; ++k) { if constexpr (PIX) issue_h(k); else issue_w(k); }
        cp_async_commit();
    }
    grid_dependency_wait();           // v6: H_in (or, PIX, W^T) is the previous kernel's output
    launch_dependents();
    if constexpr (PIX) {
        if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 32) {
#pragma unroll
            for (int j = 0; j < RPL; ++j) {
                const int r = lane + 32 * j;
                if (r < BP) yb[r] = xrow[j] >= 0 ? Y[xrow[j]] : 0;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < FS - 1; ++k) {
        if constexpr (!early) { issue_w(k); issue_h(k); }
        else if constexpr (PIX) issue_w(k);
        else issue_h(k);
        cp_async_commit();
    }

    float acc[MT][NB][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nb][e] = 0.f;
    // the k order inside a k-step is permuted identically for A and B (thread t holds inputs 4t..4t+3 at
    // fragment positions 2t, 2t+1, 2t+8, 2t+9), as in v3's gemm_rows
    for (int k = 0; k < nk; ++k) {
        issue_w(k + FS - 1);          // refill the stage freed at the end of the previous iteration
        issue_h(k + FS - 1);
        cp_async_commit();
        cp_async_wait<FS - 1>();      // this thread's copies of k-step k have landed ...
        __syncwarp();                 // ... and every lane's
        const unsigned char* st = ring + (k % FS) * FSTAGE;
        const float* ws = reinterpret_cast<const float*>(st);
        u32 b[NB][2];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const float4 w = *reinterpret_cast<const float4*>(ws + (nb * 8 + g) * 16 + 4 * t);
            b[nb][0] = pack2(w.x, w.y);
            b[nb][1] = pack2(w.z, w.w);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 a[4];
            if constexpr (PIX) {
                pixel_frag(st + FSTAGE_W, 16, mt, a);
            } else {
                const elem_t* hs = reinterpret_cast<const elem_t*>(st + FSTAGE_W);
                const uint2 h0 = *reinterpret_cast<const uint2*>(hs + (mt * 16 + g) * 16 + 4 * t);
                const uint2 h1 = *reinterpret_cast<const uint2*>(hs + (mt * 16 + g + 8) * 16 + 4 * t);
                a[0] = h0.x; a[1] = h1.x; a[2] = h0.y; a[3] = h1.y;
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) mma16816(acc[mt][nb], a, b[nb][0], b[nb][1]);
        }
        __syncwarp();                 // every lane has read stage k % FS: the next issue may overwrite it
    }
    cp_async_wait<0>();               // (only empty groups can be left)
    __syncthreads();                  // every warp is done with its ring: it becomes the reduction buffer
    store_warp_partials(red, acc);
    __syncthreads();
    if (gridDim.y == 1) {
        bias_relu_out(red, bias, hout, o0, out_p);
        return;
    }
    // v7: the cluster's reduction. This block's partial, then block y sums columns [y*BO/C, (y+1)*BO/C) of all
    // C partials (in rank order) from their shared memory.
    if (cluster_size() != gridDim.y) __trap();   // launched without its clusters: mapa would be wrong
    float* part = reinterpret_cast<float*>(fsm + FRING_RED);   // [BP][BO]
    for (int i = threadIdx.x; i < BP * BO; i += blockDim.x) {
        const int r = i / BO, c = i % BO;
        float z = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) z += red[(w * BP + r) * (BO + 1) + c];
        part[i] = z;
    }
    cluster_sync_all();               // every partial of the cluster is written
    const int cols = BO / gridDim.y, c0 = blockIdx.y * cols;
    for (int i = threadIdx.x; i < BP * cols; i += blockDim.x) {
        const int r = i / cols, c = c0 + i % cols;
        float z = bias[o0 + c];
        z += cluster_sum(smem_u32(part + r * BO + c), gridDim.y);
        hout[(size_t)r * out_p + o0 + c] = to_elem(fmaxf(z, 0.f));
    }
    cluster_sync_all();               // no block leaves while another still reads its partial
}

// a hidden (or, without v8's fold, the first) layer: H_in is the previous kernel's output
extern "C" __global__ void __launch_bounds__(256, FT_FMINB)
ft_fwd(const elem_t* __restrict__ hin, int in_p, const float* __restrict__ wt, const float* __restrict__ bias,
       elem_t* __restrict__ hout, int out_p)
{
    fwd_body<false, false>(hin, in_p, wt, bias, hout, out_p, nullptr, nullptr, nullptr, 0, 0, nullptr);
}

// v9: a hidden-to-hidden layer whose W^T is tiled (w_at)
extern "C" __global__ void __launch_bounds__(256, FT_FMINB)
ft_fwd_t(const elem_t* __restrict__ hin, int in_p, const float* __restrict__ wt, const float* __restrict__ bias,
         elem_t* __restrict__ hout, int out_p)
{
    fwd_body<false, true>(hin, in_p, wt, bias, hout, out_p, nullptr, nullptr, nullptr, 0, 0, nullptr);
}

// v8: the first layer of an MLP, reading the batch's pixels (and writing its labels) itself
extern "C" __global__ void __launch_bounds__(256, FT_FMINB)
ft_fwd_x(const u8* __restrict__ X, const int* __restrict__ Y, const int* __restrict__ order, int base, int rows,
         int* __restrict__ yb, const float* __restrict__ wt, const float* __restrict__ bias,
         elem_t* __restrict__ hout, int out_p)
{
    fwd_body<true, false>(nullptr, INPUT_BYTES, wt, bias, hout, out_p, X, Y, order, base, rows, yb);
}

// Last layer (16 padded classes) split over gridDim.x blocks; the last block to finish sums the partial
// logits, adds the bias and does softmax, loss, accuracy and g = p - onehot (stored both ways).
extern "C" __global__ void __launch_bounds__(256)
ft_fwd_last(const elem_t* __restrict__ hin, int in_p, const float* __restrict__ wt, const float* __restrict__ bias,
            const int* __restrict__ yb, int rows, int step,
            float* __restrict__ part, unsigned* __restrict__ counter,
            elem_t* __restrict__ dz, elem_t* __restrict__ dzT,
            float* __restrict__ stat_loss, int* __restrict__ stat_ok)
{
    extern __shared__ __align__(16) float red[];   // [NW][BP][17], then flags
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ksteps = in_p / 16;
    const int per = (ksteps + gridDim.x - 1) / gridDim.x;
    const int ks0 = blockIdx.x * per, ks1 = min(ksteps, ks0 + per);
    // v8: this warp's first two k-steps of W^T (written only by this layer's backward, two kernels later) are
    // loaded before the wait, up to batch 128 (beyond, the accumulators leave no registers for them); the mma
    // order is gemm_rows' (k-steps ks0 + warp, + NW, + 2 NW, ...)
    constexpr bool early = FT_EARLY && MT <= 8;
    const int ka = ks0 + warp, kb = ka + NW;
    u32 wa[2][2], wb[2][2];
    if (early) {
        if (ka < ks1) w_frags<2>(wa, wt, in_p, 0, ka);
        if (kb < ks1) w_frags<2>(wb, wt, in_p, 0, kb);
    }
    grid_dependency_wait();   // v6: hin is the previous kernel's output
    launch_dependents();
    float acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nb][e] = 0.f;
    if (early) {
        if (ka < ks1) mma_kstep<2>(acc, hin, in_p, ka, wa);
        if (kb < ks1) mma_kstep<2>(acc, hin, in_p, kb, wb);
        gemm_rows<2>(acc, hin, in_p, wt, 0, kb + NW, ks1, NW);
    } else {
        gemm_rows<2>(acc, hin, in_p, wt, 0, ka, ks1, NW);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(warp * BP + mt * 16 + g + (e >> 1) * 8) * 17 + nb * 8 + 2 * t + (e & 1)] = acc[mt][nb][e];
    __syncthreads();
    for (int i = threadIdx.x; i < BP * 16; i += blockDim.x) {
        const int r = i >> 4, c = i & 15;
        float z = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) z += red[(w * BP + r) * 17 + c];
        part[((size_t)blockIdx.x * BP + r) * 16 + c] = z;
    }
    __threadfence();
    __syncthreads();
    unsigned* flag = reinterpret_cast<unsigned*>(red + NW * BP * 17);
    if (threadIdx.x == 0) flag[0] = (atomicAdd(counter, 1u) == gridDim.x - 1);
    __syncthreads();
    if (!flag[0]) return;
    __threadfence();
    // ---- the last block: softmax and cross-entropy, one thread per row ----
    float lsum = 0.f;
    int okc = 0;
    for (int r = threadIdx.x; r < BP; r += blockDim.x) {
        float z[16];
#pragma unroll
        for (int c = 0; c < 16; ++c) z[c] = 0.f;
        for (int b = 0; b < gridDim.x; ++b) {
            const float4* pp = reinterpret_cast<const float4*>(part + ((size_t)b * BP + r) * 16);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float4 v = __ldcg(pp + q);
                z[4 * q] += v.x; z[4 * q + 1] += v.y; z[4 * q + 2] += v.z; z[4 * q + 3] += v.w;
            }
        }
        float mx = FT_NEG_INF;
        int best = 0;
#pragma unroll
        for (int c = 0; c < 10; ++c) {
            z[c] += bias[c];
            if (z[c] > mx) { mx = z[c]; best = c; }
        }
        float se = 0.f;
#pragma unroll
        for (int c = 0; c < 10; ++c) se += __expf(z[c] - mx);
        const bool live = r < rows;
        const int y = live ? yb[r] : -1;
        float zy = 0.f;
#pragma unroll
        for (int c = 0; c < 10; ++c) zy = (c == y) ? z[c] : zy;
        if (live) {
            lsum += __logf(se) - (zy - mx);
            okc += (best == y);
        }
        const float inv = 1.0f / se;
        u32 gp[8];
#pragma unroll
        for (int c = 0; c < 16; c += 2) {
            float g0 = (live && c < 10) ? __expf(z[c] - mx) * inv - (c == y) : 0.f;
            float g1 = (live && c + 1 < 10) ? __expf(z[c + 1] - mx) * inv - (c + 1 == y) : 0.f;
            gp[c / 2] = pack2(g0, g1);
            const float2 back = unpack2(gp[c / 2]);
            dzT[(size_t)c * BP + r] = to_elem(back.x);
            dzT[(size_t)(c + 1) * BP + r] = to_elem(back.y);
        }
        uint4* d = reinterpret_cast<uint4*>(dz + (size_t)r * 16);
        d[0] = make_uint4(gp[0], gp[1], gp[2], gp[3]);
        d[1] = make_uint4(gp[4], gp[5], gp[6], gp[7]);
    }
    lsum = warp_sum(lsum);
    okc = __reduce_add_sync(0xffffffffu, okc);
    __syncthreads();
    float* ls = red;
    int* oks = reinterpret_cast<int*>(red + NW);
    if (lane == 0) { ls[warp] = lsum; oks[warp] = okc; }
    __syncthreads();
    if (threadIdx.x == 0) {
        float L = 0.f;
        int A = 0;
        for (int w = 0; w < NW; ++w) { L += ls[w]; A += oks[w]; }
        stat_loss[step] = L;
        stat_ok[step] = A;
        *counter = 0u;   // ready for the next launch
    }
}

// The backward's arithmetic, shared by ft_bwd / ft_bwd_x and ft_bwd_fwd_x so that they agree bit for bit:
// sum_b g[b][o] (row o of g^T, contiguous), B' times the bias gradient
__device__ __forceinline__ float g_row_sum(const elem_t* __restrict__ dzT, int o)
{
    float s = 0.f;
    const u32* row = reinterpret_cast<const u32*>(dzT + (size_t)o * BP);
#pragma unroll
    for (int q = 0; q < BP / 2; ++q) { const float2 v = unpack2(row[q]); s += v.x + v.y; }
    return s;
}

// W^T tile (rows g, g + 8 of a 16-row chunk, columns 2t, 2t + 1 of 8) -= lr/B' * (g^T chunk @ H_in[:, 8 columns]):
// the A fragments `at` (K = batch), the B fragments by ldmatrix.trans from `hb` (batch rows 0..15 of the tile's
// columns), `kstep` bytes between the batch's 16-row blocks
__device__ __forceinline__ void sgd_tile(float2& w0, float2& w1, const u32 at[MT][4], u32 hb, int kstep, float wscale)
{
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < MT; ++kk) {
        u32 h0, h1;
        ldsm_x2_t(h0, h1, hb + kk * kstep);
        mma16816(acc, at[kk], h0, h1);
    }
    w0.x -= wscale * acc[0];
    w0.y -= wscale * acc[1];
    w1.x -= wscale * acc[2];
    w1.y -= wscale * acc[3];
}

// Backward of one layer for BI input features per block, over the output rows of its y-slice (8 warps split
// them in 16-row chunks):
//   W_old = W^T[o-chunk][strip]                                 (fp32, read once, through the warp's ring)
//   dW^T  = g^T @ H_in[:, strip]        (mma, K = batch)         -> W^T = W_old - lr/B' * dW^T, written once
//   dH   += g @ W_old^T-chunk           (mma, K = o; B fragments from W_old by movmatrix)  [need_dh]
// then dZ_prev = dH * [H_in > 0] written in both layouts. The bias update is spread over the blocks.
// grid = (in_p / BI, osplit). Without dH (the first layer) the osplit blocks of a strip are independent; with
// dH (v7) they are one cluster of (1, osplit, 1) and sum their dH partials through distributed shared memory:
//   dH[r][i] = sum_{y < osplit} part_y[r][i],  part_y = sum_{w < 8} (warp w's chunks of row slice y)
// Per block: 2 * (out_p/osplit)*BI*4 bytes of W (read + write), (out_p/osplit)*B_p*2 bytes of g^T from L2;
// 4*B_p*out_p*BI/osplit FLOP. In flight a warp: (FT_S - 1) * 16*BI*4 bytes of W (BI 64, S 4: 12 KB; v1: 4 KB).
// dz (row-major g) is not read by this version (both A fragments come from g^T); the argument stays so
// that every version takes the same arguments.
// v8, PIX (ft_bwd_x, the first layer of an MLP): the H_in strip is the batch's pixels, read through the epoch
// order and converted before griddepcontrol.wait (nothing the previous kernel writes); EARLY: the W^T part of the
// ring's first FT_S - 1 chunks is one commit group issued before the wait (only this kernel writes this W^T);
// otherwise the strip comes by cp.async in the first chunk's group, not by a load round trip after the bias.
template <bool PIX, bool TILED>
__device__ __forceinline__ void bwd_body(const elem_t* __restrict__ dzT, int out_p, const elem_t* __restrict__ hin,
                                         int in_p, float* __restrict__ wt, float* __restrict__ bias, float wscale,
                                         float bscale, int need_dh, elem_t* __restrict__ dzp, elem_t* __restrict__ dzpT,
                                         const u8* __restrict__ X, const int* __restrict__ order, int base, int rows)
{
    constexpr bool early = FT_EARLY != 0;
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* hs = reinterpret_cast<elem_t*>(smem);                           // [BP][BI+8]
    unsigned char* ring = smem + HS_BYTES + (threadIdx.x >> 5) * (FT_S * STAGE_BYTES);   // this warp's stages
    float* red = reinterpret_cast<float*>(smem + HS_BYTES);                // [NW][BP][BI+1], after the loop
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int i0 = blockIdx.x * BI;

    // this warp's chunks: cbeg + warp + k*NW for k < nk, inside the block's slice [cbeg, cend) of out_p/16
    const int nchunks = out_p / 16;
    const int per = (nchunks + gridDim.y - 1) / gridDim.y;
    const int cbeg = blockIdx.y * per, cend = min(nchunks, cbeg + per);
    const int nk = (cend - cbeg > warp) ? (cend - cbeg - warp + NW - 1) / NW : 0;

    // chunk k of this warp -> stage k % FT_S: 16 rows x BI fp32 of W^T and 16 rows x BP of g^T, 16-byte
    // cp.async (L2 only). One commit group per chunk, empty past the end, so that the group count is uniform;
    // with EARLY one more, oldest, group holds the W^T of chunks 0 .. FT_S - 2 (cp_async_wait<FT_S - 1> in the
    // loop still leaves chunk k complete: after the refill k + 2 groups, not k + 1, are done).
    auto issue_w = [&](int k) {
        if (k >= nk) return;
        const int o0 = (cbeg + warp + k * NW) * 16;
        const u32 st = smem_u32(ring + (k % FT_S) * STAGE_BYTES);
#pragma unroll
        for (int p = lane; p < 4 * BI; p += 32) {           // 16 rows x BI/4 pieces
            const int r = p / (BI / 4), c = p % (BI / 4);
            cp_async16(st + (r * WS + c * 4) * 4, wt + w_at<TILED>(o0 + r, i0 + c * 4, in_p));
        }
    };
    auto issue_g = [&](int k) {
        if (k >= nk) return;
        const int o0 = (cbeg + warp + k * NW) * 16;
        const u32 st = smem_u32(ring + (k % FT_S) * STAGE_BYTES);
#pragma unroll
        for (int p = lane; p < 2 * BP; p += 32) {           // 16 rows x BP/8 pieces (contiguous in g^T)
            const int r = p / (BP / 8), c = p % (BP / 8);
            cp_async16(st + 16 * WS * 4 + (r * GS + c * 8) * 2, dzT + (size_t)(o0 + r) * BP + c * 8);
        }
    };
    if constexpr (early) {
#pragma unroll
        for (int k = 0; k < FT_S - 1; ++k) issue_w(k);
        cp_async_commit();
    }
    if constexpr (PIX) {
        // H_in[:, strip] = pixels / 255 of the batch's rows (zero for r >= rows), 8 pixels an item
        constexpr int ITEMS = (BP * NJ + 255) / 256;
        uint2 px[ITEMS];
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            const int i = threadIdx.x + 256 * j, r = i / NJ, c = i % NJ;
            const int idx = (i < BP * NJ && r < rows) ? order[base + r] : -1;
            px[j] = idx >= 0 ? *reinterpret_cast<const uint2*>(X + (size_t)idx * INPUT_BYTES + i0 + c * 8)
                             : make_uint2(0u, 0u);
        }
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            const int i = threadIdx.x + 256 * j, r = i / NJ, c = i % NJ;
            if (i < BP * NJ) *reinterpret_cast<uint4*>(hs + r * (BI + 8) + c * 8) = pixels8(px[j]);
        }
    }
    grid_dependency_wait();           // v6: g is the previous kernel's output
    launch_dependents();
    if constexpr (!PIX) {             // the H_in strip joins the first chunk's group
        for (int i = threadIdx.x; i < BP * NJ; i += blockDim.x) {
            const int r = i / NJ, c = i % NJ;
            cp_async16(smem_u32(hs + r * (BI + 8) + c * 8), hin + (size_t)r * in_p + i0 + c * 8);
        }
    }
    // the ring starts filling before the bias update
#pragma unroll
    for (int k = 0; k < FT_S - 1; ++k) {
        if constexpr (!early) issue_w(k);
        issue_g(k);
        cp_async_commit();
    }

    // bias: b[o] -= lr/B' * sum_b g[b][o], spread over all blocks (g^T rows are contiguous)
    const int nblk = gridDim.x * gridDim.y, bid = blockIdx.y * gridDim.x + blockIdx.x;
    for (int o = bid * blockDim.x + threadIdx.x; o < out_p; o += nblk * blockDim.x) bias[o] -= bscale * g_row_sum(dzT, o);
    cp_async_wait<FT_S - 2>();        // the first chunk's group (with the strip) has landed for this thread ...
    __syncthreads();                  // ... and for every thread
    // B fragments of H_in[:, strip] (k = batch rows, n = 8 features) are read from hs by ldmatrix.trans
    // where they are used (v1 kept all 2 MT NJ of them in registers: with them, BI 64 needs 205 registers and
    // BI 32 spills at 3 blocks an SM; without, BI 64 / 2 blocks and BI 32 / 3 blocks fit with no spills)
    const u32 hb_base = smem_u32(hs + (lane & 15) * (BI + 8));

    float dh[MT][NJ][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dh[mt][j][e] = 0.f;

    // ldmatrix row addresses inside a stage's g^T (lane l serves matrix l/8, row l%8):
    //   A = g^T (m = o, k = batch), matrices (o 0-7, b 0-7), (o 8-15, b 0-7), (o 0-7, b 8-15), (o 8-15, b 8-15)
    //   A = g   (m = batch, k = o), .trans of (o 0-7, b 0-7), (o 0-7, b 8-15), (o 8-15, b 0-7), (o 8-15, b 8-15)
    const int at_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * GS + (lane >> 4) * 8;
    const int ad_off = ((lane & 7) + (lane >> 4) * 8) * GS + ((lane >> 3) & 1) * 8;

    for (int k = 0; k < nk; ++k) {
        issue_w(k + FT_S - 1);        // refill the stage freed at the end of the previous iteration
        issue_g(k + FT_S - 1);
        cp_async_commit();
        cp_async_wait<FT_S - 1>();    // this thread's copies of chunk k have landed ...
        __syncwarp();                 // ... and every lane's
        const unsigned char* st = ring + (k % FT_S) * STAGE_BYTES;
        const float* ws = reinterpret_cast<const float*>(st);
        const elem_t* gts = reinterpret_cast<const elem_t*>(st + 16 * WS * 4);
        const int o0 = (cbeg + warp + k * NW) * 16;
        float* wrow0 = wt + w_at<TILED>(o0 + g, i0 + 2 * t, in_p);       // this thread's W^T rows, column i0 + 2t
        float* wrow1 = wt + w_at<TILED>(o0 + g + 8, i0 + 2 * t, in_p);
        u32 at[MT][4], ad[MT][4];
#pragma unroll
        for (int kk = 0; kk < MT; ++kk) ldsm_x4(at[kk], smem_u32(gts + at_off + kk * 16));
        if (need_dh) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldsm_x4_t(ad[mt], smem_u32(gts + ad_off + mt * 16));
        }
        // one 8-column tile at a time: its W_old (2 x float2 from the stage) feeds dH (B = W_old^T by
        // movmatrix) and is then updated and stored, so only 4 floats of W are live (not 4 NJ)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            float2 w0 = *reinterpret_cast<const float2*>(ws + g * WS + j * 8 + 2 * t);
            float2 w1 = *reinterpret_cast<const float2*>(ws + (g + 8) * WS + j * 8 + 2 * t);
            if (need_dh) {
                const u32 b0 = movmatrix_t(pack2(w0.x, w0.y));
                const u32 b1 = movmatrix_t(pack2(w1.x, w1.y));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma16816(dh[mt][j], ad[mt], b0, b1);
            }
            sgd_tile(w0, w1, at, hb_base + j * 8 * 2, 16 * (BI + 8) * 2, wscale);
            // columns i0 + j*8 + 2t: tiled, 8-column tile j is in 16-input tile j/2 (i0 is a multiple of 16 when
            // NJ > 1), at column (j % 2) * 8 of it
            const int jo = TILED ? (j >> 1) * (BO * 16) + (j & 1) * 8 : j * 8;
            *reinterpret_cast<float2*>(wrow0 + jo) = w0;
            *reinterpret_cast<float2*>(wrow1 + jo) = w1;
        }
        __syncwarp();                 // every lane has read stage k % FT_S: the next issue may overwrite it
    }
    cp_async_wait<0>();               // (only empty groups can be left)
    if (!need_dh) return;
    __syncthreads();                  // every warp is done with its ring: it becomes the reduction buffer
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(warp * BP + mt * 16 + g + (e >> 1) * 8) * (BI + 1) + j * 8 + 2 * t + (e & 1)] = dh[mt][j][e];
    __syncthreads();
    if (gridDim.y == 1) {
        for (int i = threadIdx.x; i < BP * BI; i += blockDim.x) {
            const int r = i / BI, c = i % BI;
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) s += red[(w * BP + r) * (BI + 1) + c];
            const float hv = from_elem(hs[r * (BI + 8) + c]);
            const elem_t v = to_elem(hv > 0.f ? s : 0.f);   // ReLU'(z) = [h > 0]
            dzp[(size_t)r * in_p + i0 + c] = v;
            dzpT[(size_t)(i0 + c) * BP + r] = v;
        }
        return;
    }
    // v7: the cluster's reduction (as ft_fwd's): this block's partial, then block y sums its column slice
    if (cluster_size() != gridDim.y) __trap();   // launched without its clusters: mapa would be wrong
    float* part = reinterpret_cast<float*>(smem + HS_BYTES + RING_RED);   // [BP][BI]
    for (int i = threadIdx.x; i < BP * BI; i += blockDim.x) {
        const int r = i / BI, c = i % BI;
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) s += red[(w * BP + r) * (BI + 1) + c];
        part[i] = s;
    }
    cluster_sync_all();               // every partial of the cluster is written
    const int cols = BI / gridDim.y, c0 = blockIdx.y * cols;
    for (int i = threadIdx.x; i < BP * cols; i += blockDim.x) {
        const int r = i / cols, c = c0 + i % cols;
        const float s = cluster_sum(smem_u32(part + r * BI + c), gridDim.y);
        const float hv = from_elem(hs[r * (BI + 8) + c]);
        const elem_t v = to_elem(hv > 0.f ? s : 0.f);   // ReLU'(z) = [h > 0]
        dzp[(size_t)r * in_p + i0 + c] = v;
        dzpT[(size_t)(i0 + c) * BP + r] = v;
    }
    cluster_sync_all();               // no block leaves while another still reads its partial
}

extern "C" __global__ void __launch_bounds__(256, FT_MINB)
ft_bwd(const elem_t* __restrict__ dz, const elem_t* __restrict__ dzT, int out_p,
       const elem_t* __restrict__ hin, int in_p,
       float* __restrict__ wt, float* __restrict__ bias, float wscale, float bscale, int need_dh,
       elem_t* __restrict__ dzp, elem_t* __restrict__ dzpT)
{
    (void)dz;
    bwd_body<false, false>(dzT, out_p, hin, in_p, wt, bias, wscale, bscale, need_dh, dzp, dzpT, nullptr, nullptr, 0, 0);
}

// v9: a hidden-to-hidden layer whose W^T is tiled (w_at)
extern "C" __global__ void __launch_bounds__(256, FT_MINB)
ft_bwd_t(const elem_t* __restrict__ dz, const elem_t* __restrict__ dzT, int out_p,
         const elem_t* __restrict__ hin, int in_p,
         float* __restrict__ wt, float* __restrict__ bias, float wscale, float bscale, int need_dh,
         elem_t* __restrict__ dzp, elem_t* __restrict__ dzpT)
{
    (void)dz;
    bwd_body<false, true>(dzT, out_p, hin, in_p, wt, bias, wscale, bscale, need_dh, dzp, dzpT, nullptr, nullptr, 0, 0);
}

// v8: the first layer of an MLP (no dH), its H_in strip read from the batch's pixels
extern "C" __global__ void __launch_bounds__(256, FT_MINB)
ft_bwd_x(const elem_t* __restrict__ dzT, int out_p, const u8* __restrict__ X, const int* __restrict__ order,
         int base, int rows, float* __restrict__ wt, float* __restrict__ bias, float wscale, float bscale)
{
    bwd_body<true, false>(dzT, out_p, nullptr, INPUT_BYTES, wt, bias, wscale, bscale, 0, nullptr, nullptr, X, order, base, rows);
}

// v8: the first layer's backward of step k and its forward of step k+1 in one kernel (every step of an epoch but
// the last; the first step runs ft_fwd_x, the last ft_bwd_x). A block owns BO rows of W^T, all 784 inputs, so the
// forward needs no split-K across blocks: it reads the rows it has just updated from its own shared memory. W^T of
// the first layer is read once a step instead of twice, and one kernel boundary goes. The sums are ft_bwd_x's and
// ft_fwd_x's, in the same order:
//   W^T[o][:] -= lr/B' * (g_k^T @ X_k)[o][:]   (mma, K = batch: one 16 x 8 tile at a time, as ft_bwd)
//   b[o] -= lr/B' * sum_b g_k[b][o]
//   H1_{k+1} = relu(X_{k+1} @ W^T[tile]^T + b)  (warp w takes the k-steps w, w + 8, ..., as ft_fwd)
// Before griddepcontrol.wait (the previous kernel, the second layer's backward, writes g_k only): the W^T rows and
// the pixels of both batches, all by cp.async, and X_k's conversion. Shared memory: W^T [BO][784 + 4] fp32, X_k
// [B_p][784 + 8] in the operand type (reused as the forward's reduction buffer), X_{k+1} [B_p][784] pixels, g_k^T
// rows [BO][B_p + 8], the two batches' rows, X_k's pixels [B_p][784].
// BO must be a multiple of 16 (whole 16-row chunks of g^T); the host launches it only then.
#define WTS (INPUT_BYTES + 4)       // W^T row stride in floats (3152 B)
#define XKS (INPUT_BYTES + 8)       // X_k row stride in elements (1584 B = 48 mod 128: ldmatrix rows on distinct banks)
#define BF_W (BO * WTS * 4)
#define BF_XK ((BP * XKS * 2) > (NW * BP * (BO + 1) * 4) ? (BP * XKS * 2) : (NW * BP * (BO + 1) * 4))
#define BF_XN (BP * INPUT_BYTES)
#define BF_G (BO * GS * 2)
extern "C" __constant__ int ft_bwd_fwd_x_smem = BF_W + BF_XK + BF_XN + BF_G + 2 * BP * 4 + BF_XN;

extern "C" __global__ void __launch_bounds__(256, 1)
ft_bwd_fwd_x(const elem_t* __restrict__ dzT, int out_p, const u8* __restrict__ X, const int* __restrict__ Y,
             const int* __restrict__ order, int base, int rows, int nbase, int nrows, int* __restrict__ yb,
             float* __restrict__ wt, float* __restrict__ bias, float wscale, float bscale, elem_t* __restrict__ hout)
{
    constexpr int IN = INPUT_BYTES, NT = INPUT_BYTES / 8;   // inputs, 8-column tiles of the backward
    extern __shared__ __align__(16) unsigned char sm[];
    float* ws = reinterpret_cast<float*>(sm);                               // [BO][WTS]
    elem_t* xk = reinterpret_cast<elem_t*>(sm + BF_W);                      // [BP][XKS]
    float* red = reinterpret_cast<float*>(sm + BF_W);                       // [NW][BP][BO+1], after the backward
    u8* xn = sm + BF_W + BF_XK;                                             // [BP][IN]
    elem_t* gts = reinterpret_cast<elem_t*>(sm + BF_W + BF_XK + BF_XN);     // [BO][GS]
    int* rk = reinterpret_cast<int*>(sm + BF_W + BF_XK + BF_XN + BF_G);     // pixel rows of batch k, then k+1
    int* rn = rk + BP;
    u8* xku = reinterpret_cast<u8*>(rn + BP);                                // [BP][IN]: X_k's pixels
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int o0 = blockIdx.x * BO;
    if (!FT_EARLY) { grid_dependency_wait(); launch_dependents(); }

    // ---- before the wait (EARLY): nothing here is written by the previous kernel ----
    for (int p = threadIdx.x; p < BO * (IN / 4); p += blockDim.x) {           // W^T rows, 16 bytes a copy
        const int r = p / (IN / 4), c = p % (IN / 4);
        cp_async16(smem_u32(ws + r * WTS + c * 4), wt + (size_t)(o0 + r) * IN + c * 4);
    }
    for (int r = threadIdx.x; r < BP; r += blockDim.x) {
        rk[r] = r < rows ? order[base + r] : -1;
        rn[r] = r < nrows ? order[nbase + r] : -1;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < BP * (IN / 16); p += blockDim.x) {         // both batches' pixels
        const int r = p / (IN / 16), c = p % (IN / 16), in = rn[r], ik = rk[r];
        cp_async16_zfill(smem_u32(xn + r * IN + c * 16), X + (size_t)max(in, 0) * IN + c * 16, in >= 0);
        cp_async16_zfill(smem_u32(xku + r * IN + c * 16), X + (size_t)max(ik, 0) * IN + c * 16, ik >= 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int p = threadIdx.x; p < BP * NT; p += blockDim.x) {                // X_k = pixels / 255, 8 an item
        const int r = p / NT, c = p % NT;
        *reinterpret_cast<uint4*>(xk + r * XKS + c * 8) = pixels8(*reinterpret_cast<const uint2*>(xku + r * IN + c * 8));
    }
    if (FT_EARLY) { grid_dependency_wait(); launch_dependents(); }   // g_k is the previous kernel's output
    for (int p = threadIdx.x; p < BO * (BP / 8); p += blockDim.x) {          // g_k^T rows of the tile
        const int r = p / (BP / 8), c = p % (BP / 8);
        cp_async16(smem_u32(gts + r * GS + c * 8), dzT + (size_t)(o0 + r) * BP + c * 8);
    }
    cp_async_commit();
    if (blockIdx.x == 0) {                                                   // the labels of step k+1
        for (int r = threadIdx.x; r < BP; r += blockDim.x) yb[r] = rn[r] >= 0 ? Y[rn[r]] : 0;
    }
    if (threadIdx.x < BO) bias[o0 + threadIdx.x] -= bscale * g_row_sum(dzT, o0 + threadIdx.x);   // ft_bwd's sum
    cp_async_wait<0>();
    __syncthreads();

    // ---- backward of step k: one (16-row chunk, 8-column tile) a warp at a time, fragments as ft_bwd's ----
    const int at_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * GS + (lane >> 4) * 8;
    const u32 hb_base = smem_u32(xk + (lane & 15) * XKS);
    for (int item = warp; item < (BO / 16) * NT; item += NW) {
        const int ch = item / NT, j = item % NT;
        u32 at[MT][4];
#pragma unroll
        for (int kk = 0; kk < MT; ++kk) ldsm_x4(at[kk], smem_u32(gts + ch * 16 * GS + at_off + kk * 16));
        float* p0 = ws + (ch * 16 + g) * WTS + j * 8 + 2 * t;
        float* p1 = p0 + 8 * WTS;
        float2 w0 = *reinterpret_cast<float2*>(p0), w1 = *reinterpret_cast<float2*>(p1);
        sgd_tile(w0, w1, at, hb_base + j * 8 * 2, 16 * XKS * 2, wscale);
        *reinterpret_cast<float2*>(p0) = w0;
        *reinterpret_cast<float2*>(p1) = w1;
        *reinterpret_cast<float2*>(wt + (size_t)(o0 + ch * 16 + g) * IN + j * 8 + 2 * t) = w0;
        *reinterpret_cast<float2*>(wt + (size_t)(o0 + ch * 16 + g + 8) * IN + j * 8 + 2 * t) = w1;
    }
    __syncthreads();                  // the tile is updated; X_k is dead: its space becomes the reduction buffer

    // ---- forward of step k+1 from the updated rows (ft_fwd_x's k-steps, fragments and reduction) ----
    float acc[MT][NB][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nb][e] = 0.f;
    for (int ks = warp; ks < IN / 16; ks += NW) {
        u32 b[NB][2];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const float4 w = *reinterpret_cast<const float4*>(ws + (nb * 8 + g) * WTS + ks * 16 + 4 * t);
            b[nb][0] = pack2(w.x, w.y);
            b[nb][1] = pack2(w.z, w.w);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 a[4];
            pixel_frag(xn + ks * 16, IN, mt, a);
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) mma16816(acc[mt][nb], a, b[nb][0], b[nb][1]);
        }
    }
    store_warp_partials(red, acc);
    __syncthreads();
    bias_relu_out(red, bias, hout, o0, out_p);   // the bias updated above by this block (visible after the barrier)
}
