// fused_step_v1.cu: rung 7, fused tensor-core training step for any MLP (and logreg), captured in a CUDA graph.
//
// Version history (llm.c dev/cuda style; NOTES-fused.md has the prediction and outcome of each):
//   v1  Per step: ft_gather (batch rows -> fp16/bf16), one ft_fwd per hidden layer (GEMM + bias + ReLU,
//       K split over 8 warps), ft_fwd_last (last GEMM split over blocks, the last block to finish does
//       bias + softmax + loss + accuracy + g = p - onehot), one ft_bwd per layer (the weight-gradient GEMM
//       with the SGD update fused: W^T is read once, dH_in = g @ W (old W) and W -= lr dW computed from the
//       same registers, dW never written; ReLU mask fused into the dH epilogue). fp32 master W^T is the only
//       weight copy: the forward converts it to fp16/bf16 on the fly, so each step moves 12 bytes/parameter
//       (read fwd 4 + read bwd 4 + write 4): that is the floor for fp32 master weights.
//
// Layout: W^T [out_p][in_p] fp32 row-major (p = padded to 16; padding rows/columns are zero and stay zero),
// activations H [B_p][w_p] in the operand type, g / dZ in both [B_p][w_p] and transposed [w_p][B_p] layouts.
// g is kept unscaled (softmax - onehot, |g| <= 1) and every backward value is B' times the true gradient;
// the 1/B' goes into the update scale (lr / B'), which keeps fp16 away from underflow.
//
// Compile-time configuration (-D): FT_MT m-tiles of the batch (B_p = 16*FT_MT), FT_BO outputs per ft_fwd
// block, FT_BI input features per ft_bwd block (multiples of 8), FT_BF16.
// Compile alone: nvcc --ptx -arch=sm_90 fused_step_v1.cu (the defaults below: batch 32, 64-wide tiles, fp16)
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
#include "fused_common.cuh"

#define MT FT_MT
#define BP (MT * 16)
#define NW 8
#define BO FT_BO
#define NB (BO / 8)
#define BI FT_BI
#define NJ (BI / 8)

// dynamic shared memory each kernel needs (read by the host through these symbols)
extern "C" __constant__ int ft_fwd_smem = NW * BP * (BO + 1) * 4;
extern "C" __constant__ int ft_last_smem = NW * BP * 17 * 4 + 64;
extern "C" __constant__ int ft_bwd_smem = BP * (BI + 8) * 2 + NW * BP * (BI + 1) * 4;

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

// Batch rows -> x = pixel/255 in the operand type; rows >= rows are zero. grid = B_p blocks of 64 threads.
// Bytes: 784 read + 1568 written per row.
extern "C" __global__ void __launch_bounds__(64)
ft_gather(const u8* __restrict__ X, const int* __restrict__ Y, const int* __restrict__ order, int base, int rows,
          elem_t* __restrict__ xb, int* __restrict__ yb)
{
    const int r = blockIdx.x;
    const int c = threadIdx.x;   // 16-byte chunk, 49 per row
    const int idx = (r < rows) ? order[base + r] : -1;
    if (c == 0) yb[r] = (idx >= 0) ? Y[idx] : 0;
    if (c >= 49) return;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (idx >= 0) v = *reinterpret_cast<const uint4*>(X + (size_t)idx * 784 + c * 16);
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    u32 o[8];
    const float s = 1.0f / 255.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        o[2 * k] = pack2((float)(w[k] & 0xff) * s, (float)((w[k] >> 8) & 0xff) * s);
        o[2 * k + 1] = pack2((float)((w[k] >> 16) & 0xff) * s, (float)(w[k] >> 24) * s);
    }
    uint4* d = reinterpret_cast<uint4*>(xb + (size_t)r * 784 + c * 16);
    d[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// acc[mt][nb] += H[:, k-range] @ W^T[o0 + nb*8 .., k-range]^T over k-steps ks0, ks0+kstride, ... < ks1.
// The k order inside a 16-step is permuted identically for A and B (thread t holds actual k 4t..4t+3 at
// fragment positions 2t,2t+1,2t+8,2t+9), so each thread reads 16 contiguous bytes of W and 8 of H.
template <int NBT>
__device__ __forceinline__ void gemm_rows(float acc[MT][NBT][4], const elem_t* __restrict__ h, int in_p,
                                          const float* __restrict__ wt, int o0, int ks0, int ks1, int kstride)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 2
    for (int ks = ks0; ks < ks1; ks += kstride) {
        const int k0 = ks * 16 + 4 * t;
        u32 b[NBT][2];
#pragma unroll
        for (int nb = 0; nb < NBT; ++nb) {
            const float4 w = __ldg(reinterpret_cast<const float4*>(wt + (size_t)(o0 + nb * 8 + g) * in_p + k0));
            b[nb][0] = pack2(w.x, w.y);
            b[nb][1] = pack2(w.z, w.w);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const uint2 h0 = *reinterpret_cast<const uint2*>(h + (size_t)(mt * 16 + g) * in_p + k0);
            const uint2 h1 = *reinterpret_cast<const uint2*>(h + (size_t)(mt * 16 + g + 8) * in_p + k0);
            const u32 a[4] = {h0.x, h1.x, h0.y, h1.y};
#pragma unroll
            for (int nb = 0; nb < NBT; ++nb) mma16816(acc[mt][nb], a, b[nb][0], b[nb][1]);
        }
    }
}

// H_out = relu(H_in @ W + b) for BO outputs per block; the 8 warps split K and reduce through shared memory.
// Per block: BO*in_p*4 bytes of W (read once per step), B_p*in_p*2 bytes of H_in (from L2); 2*B_p*BO*in_p FLOP.
extern "C" __global__ void __launch_bounds__(256)
ft_fwd(const elem_t* __restrict__ hin, int in_p, const float* __restrict__ wt, const float* __restrict__ bias,
       elem_t* __restrict__ hout, int out_p)
{
    extern __shared__ __align__(16) float red[];   // [NW][BP][BO+1]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int o0 = blockIdx.x * BO;
    float acc[MT][NB][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nb][e] = 0.f;
    gemm_rows<NB>(acc, hin, in_p, wt, o0, warp, in_p / 16, NW);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(warp * BP + mt * 16 + g + (e >> 1) * 8) * (BO + 1) + nb * 8 + 2 * t + (e & 1)] = acc[mt][nb][e];
    __syncthreads();
    for (int i = threadIdx.x; i < BP * BO; i += blockDim.x) {
        const int r = i / BO, c = i % BO;
        float z = bias[o0 + c];
#pragma unroll
        for (int w = 0; w < NW; ++w) z += red[(w * BP + r) * (BO + 1) + c];
        hout[(size_t)r * out_p + o0 + c] = to_elem(fmaxf(z, 0.f));
    }
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
    float acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < 2; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nb][e] = 0.f;
    gemm_rows<2>(acc, hin, in_p, wt, 0, ks0 + warp, ks1, NW);
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

// Backward of one layer for BI input features per block, over all out_p outputs (8 warps split them):
//   W_old = W^T[o-chunk][strip]                                 (fp32, read once)
//   dW^T  = g^T @ H_in[:, strip]        (mma, K = batch)         -> W^T = W_old - lr/B' * dW^T, written once
//   dH   += g @ W_old^T-chunk           (mma, K = o; B fragments from W_old by movmatrix)  [need_dh]
// then dZ_prev = dH * [H_in > 0] written in both layouts. The bias update is spread over the blocks.
// Per block: 2 * out_p*BI*4 bytes of W (read + write), out_p*B_p*2*2 bytes of g from L2; 4*B_p*out_p*BI FLOP.
extern "C" __global__ void __launch_bounds__(256)
ft_bwd(const elem_t* __restrict__ dz, const elem_t* __restrict__ dzT, int out_p,
       const elem_t* __restrict__ hin, int in_p,
       float* __restrict__ wt, float* __restrict__ bias, float wscale, float bscale, int need_dh,
       elem_t* __restrict__ dzp, elem_t* __restrict__ dzpT)
{
    extern __shared__ __align__(16) unsigned char smem[];
    elem_t* hs = reinterpret_cast<elem_t*>(smem);                           // [BP][BI+8]
    float* red = reinterpret_cast<float*>(smem + BP * (BI + 8) * 2);       // [NW][BP][BI+1]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int i0 = blockIdx.x * BI;

    // bias: b[o] -= lr/B' * sum_b g[b][o], spread over the blocks (g^T rows are contiguous)
    for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < out_p; o += gridDim.x * blockDim.x) {
        float s = 0.f;
        const u32* row = reinterpret_cast<const u32*>(dzT + (size_t)o * BP);
#pragma unroll
        for (int q = 0; q < BP / 2; ++q) { const float2 v = unpack2(row[q]); s += v.x + v.y; }
        bias[o] -= bscale * s;
    }
    for (int i = threadIdx.x; i < BP * NJ; i += blockDim.x) {
        const int r = i / NJ, c = i % NJ;
        *reinterpret_cast<uint4*>(hs + r * (BI + 8) + c * 8) =
            *reinterpret_cast<const uint4*>(hin + (size_t)r * in_p + i0 + c * 8);
    }
    __syncthreads();
    // B fragments of H_in[:, strip] (k = batch rows, n = 8 features), kept in registers
    u32 hb[MT][NJ][2];
#pragma unroll
    for (int kk = 0; kk < MT; ++kk)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
            ldsm_x2_t(hb[kk][j][0], hb[kk][j][1], smem_u32(hs + (kk * 16 + (lane & 15)) * (BI + 8) + j * 8));

    float dh[MT][NJ][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dh[mt][j][e] = 0.f;

    for (int oc = warp; oc < out_p / 16; oc += NW) {
        const int o0 = oc * 16;
        float2 w[NJ][2];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            w[j][0] = *reinterpret_cast<const float2*>(wt + (size_t)(o0 + g) * in_p + i0 + j * 8 + 2 * t);
            w[j][1] = *reinterpret_cast<const float2*>(wt + (size_t)(o0 + g + 8) * in_p + i0 + j * 8 + 2 * t);
        }
        u32 at[MT][4];   // A = g^T (m = o, k = batch)
#pragma unroll
        for (int kk = 0; kk < MT; ++kk) {
            const u32* r0 = reinterpret_cast<const u32*>(dzT + (size_t)(o0 + g) * BP + kk * 16 + 2 * t);
            const u32* r1 = reinterpret_cast<const u32*>(dzT + (size_t)(o0 + g + 8) * BP + kk * 16 + 2 * t);
            at[kk][0] = r0[0];
            at[kk][1] = r1[0];
            at[kk][2] = r0[4];
            at[kk][3] = r1[4];
        }
        if (need_dh) {
            u32 ad[MT][4];   // A = g (m = batch, k = o)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u32* r0 = reinterpret_cast<const u32*>(dz + (size_t)(mt * 16 + g) * out_p + o0 + 2 * t);
                const u32* r1 = reinterpret_cast<const u32*>(dz + (size_t)(mt * 16 + g + 8) * out_p + o0 + 2 * t);
                ad[mt][0] = r0[0];
                ad[mt][1] = r1[0];
                ad[mt][2] = r0[4];
                ad[mt][3] = r1[4];
            }
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const u32 b0 = movmatrix_t(pack2(w[j][0].x, w[j][0].y));
                const u32 b1 = movmatrix_t(pack2(w[j][1].x, w[j][1].y));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma16816(dh[mt][j], ad[mt], b0, b1);
            }
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < MT; ++kk) mma16816(acc, at[kk], hb[kk][j][0], hb[kk][j][1]);
            w[j][0].x -= wscale * acc[0];
            w[j][0].y -= wscale * acc[1];
            w[j][1].x -= wscale * acc[2];
            w[j][1].y -= wscale * acc[3];
            *reinterpret_cast<float2*>(wt + (size_t)(o0 + g) * in_p + i0 + j * 8 + 2 * t) = w[j][0];
            *reinterpret_cast<float2*>(wt + (size_t)(o0 + g + 8) * in_p + i0 + j * 8 + 2 * t) = w[j][1];
        }
    }
    if (!need_dh) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(warp * BP + mt * 16 + g + (e >> 1) * 8) * (BI + 1) + j * 8 + 2 * t + (e & 1)] = dh[mt][j][e];
    __syncthreads();
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
}
