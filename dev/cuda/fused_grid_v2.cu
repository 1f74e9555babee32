// fused_grid_v2.cu: rung 8 for wider MLPs (hidden width 256..1024): one persistent grid per epoch, every
// layer's weights resident in shared memory as 2-D tiles spread over ~128 SMs, no grid-wide barrier.
//
// Version history (llm.c dev/cuda style; NOTES-fused.md has the prediction and outcome of each):
//   v1  2-D weight tiles resident in shared memory (fp32 master + fp16/bf16 copy), exchanges through L2 with
//       one release flag per tile and phase; a consumer acquires exactly the flags of the tiles it reads.
//       Measured (H200): mlp:1024x3 126 ms a run (25 us a step, 8 hops of ~3 us): every consumer read all the
//       fp32 partials of its input slice (128 KB), 16 MB of L2 reads a hop, the L2 bandwidth was the hop time.
//   v2  Two-level exchange: between the partials and their consumers, a reduce phase in which CTA j sums the
//       partials of one FT_CW-column chunk of the activation (or dZ) once and publishes it complete in fp16;
//       consumers read complete fp16 slices. L2 traffic a hop 16 MB -> ~2 MB, at the price of a second flag
//       round trip. The next step's order indices are loaded at the top of the step (v1 stalled on them).
//       The flags are published with a release store alone (no fence.sc; FT_SCFENCE=1 puts it back).
//
// Tiling. Hidden layer l (W_l: H x H, stored W^T [out][in] fp32 in global memory) is cut into FT_A x FT_B
// tiles of TA = H/FT_A inputs by TB = H/FT_B outputs; layer 1 (784 x H) into 7 x FT_B tiles of 112 inputs;
// the last layer (H x 10, padded to 16) into FT_A tiles of TA inputs. CTA c owns tile c of every layer that
// has one, for the whole epoch (the biases live with the a = 0 tiles); global memory holds the weights only
// between launches. mlp:1024x3 with FT_A = 8, FT_B = 16: 128 CTAs, 112 + 128 + 128 + 8 tiles.
//
// One step (B' = batch rows padded to 16; P, Q, DZ in global memory, double-buffered by step parity):
//   fwd, tile (a,b) of layer l:  h_{l-1}[:, a] = relu(sum_a'' P_{l-1}[a''][:, a])        (layer 1: x = pixel/255)
//                                P_l[a][:, b] = h_{l-1}[:, a] @ W_l[a, b]  (+ b_l[b] in the a = 0 partial)
//   last layer, tile a:          logits = sum_a'' P_L[a'']; g = softmax - onehot (0 for padding rows)
//                                DZ[:, a] = (g @ W_L[a]^T) * [h_NL[:, a] > 0]                 (complete, fp16)
//   bwd, tile (a,b) of layer l:  dz_l[:, b] = DZ[:, b] (l = NL) or sum_b'' Q_{l+1}[b''][:, b]   (masked partials)
//                                Q_l[b][:, a] = (dz_l[:, b] @ W_l[a, b]^T) * [h_{l-1}[:, a] > 0]  (l >= 2, old W)
//                                W_l[a,b] -= lr/B' h_{l-1}[:, a]^T @ dz_l[:, b];  b_l[b] -= lr/B' colsum(dz_l[:, b])
// g is unscaled (|g| <= 1) and every backward value is B' times the true gradient, as in rung 7.
//
// Why no barrier is needed. Each CTA runs its phases in one global order (fwd 1..L, bwd L..1); every wait is
// for an earlier phase, so with all CTAs resident the grid cannot deadlock. A tile's next forward needs only
// its own updated weights. Buffer reuse: a buffer of parity p written at step s+2 was read at step s; the
// writer's step-(s+1) backward waited (through the logits, which depend on every forward tile of every layer)
// for every CTA's step-(s+1) forward, which each CTA runs after its step-s reads.
//
// Bytes a step and CTA (mlp:1024x3, B' = 32): forward reads 8 partials x 32 x 128 x 4 = 128 KB per hidden
// layer from L2, backward 16 x 32 x 64 x 4 = 128 KB; pixels 32 x 112 = 3.5 KB. FLOP: 6 * 32 * 2.91 M = 0.56 G
// a step over 128 SMs (~4.4 MFLOP an SM: ~1 us of mma.sync). The chain: 8 dependent hops a step
// (flag latency + partial reads + a few hundred ns of mma each).
//
// Compile-time configuration (-D): FT_H padded hidden width, FT_NL hidden layers, FT_A / FT_B tile counts of
// the hidden layers (FT_B % FT_A == 0), FT_MT batch m-tiles, FT_BF16, FT_PROF.
// Compile alone: nvcc --ptx -arch=sm_90 fused_grid_v1.cu (defaults: mlp:1024x3, batch 32, fp16)
#ifndef FT_H
#define FT_H 1024
#endif
#ifndef FT_NL
#define FT_NL 3
#endif
#ifndef FT_A
#define FT_A 8
#endif
#ifndef FT_B
#define FT_B 16
#endif
#ifndef FT_MT
#define FT_MT 2
#endif
#ifndef FT_CW
#define FT_CW 8               // columns of an activation / dZ chunk summed by one CTA in the reduce phases
#endif
#ifndef FT_BF16
#define FT_BF16 0
#endif
#ifndef FT_PROF
#define FT_PROF 0
#endif
#include "fused_common.cuh"

#define MT FT_MT
#define BP (MT * 16)
#define H FT_H
#define NL FT_NL
#define LL (NL + 1)           // layers with weights; layer LL is the last (H -> 10, padded 16)
#define TA (H / FT_A)
#define TB (H / FT_B)
#define A1 7                  // layer 1: 784 = 7 x 112 inputs
#define TA1 112
#define NWARP 8
#define NTHR (NWARP * 32)
#define DZW (TB > 16 ? TB : 16)
#define DZS (DZW + 8)         // row stride (elements) of the dz tile in shared memory
#define AMAX (A1 > FT_A ? A1 : FT_A)

static_assert(FT_B % FT_A == 0, "the forward reads whole output tiles: TA must be a multiple of TB");
static_assert(TB % 16 == 0 && TA % 16 == 0, "tiles are whole mma blocks");
static_assert(NL >= 1 && NL <= 6, "1..6 hidden layers");
static_assert(TB % FT_CW == 0 && FT_CW % 2 == 0, "a chunk lies inside one output tile; fp16 pairs");
#define NR (H / FT_CW)        // reducer CTAs (c < NR)

__host__ __device__ constexpr int in_t(int l) { return l == 1 ? TA1 : TA; }
__host__ __device__ constexpr int out_t(int l) { return l == LL ? 16 : TB; }
__host__ __device__ constexpr int n_a(int l) { return l == 1 ? A1 : FT_A; }
__host__ __device__ constexpr int n_b(int l) { return l == LL ? 1 : FT_B; }
__host__ __device__ constexpr int in_p(int l) { return l == 1 ? 784 : H; }
__host__ __device__ constexpr int tiles(int l) { return n_a(l) * n_b(l); }
__host__ __device__ constexpr int grid_size() {
    int g = 0;
    for (int l = 1; l <= LL; ++l) g = tiles(l) > g ? tiles(l) : g;
    return g;
}
#define G (grid_size())

// ---- shared memory layout (bytes, 128-aligned blocks) ----
__host__ __device__ constexpr int al(int x) { return (x + 127) / 128 * 128; }
__host__ __device__ constexpr int wm_bytes(int l) { return al(out_t(l) * (in_t(l) + 4) * 4); }   // fp32 master W^T tile
__host__ __device__ constexpr int wh_bytes(int l) { return al(out_t(l) * (in_t(l) + 8) * 2); }   // fp16/bf16 copy
__host__ __device__ constexpr int hs_bytes(int l) { return al(BP * (in_t(l) + 8) * 2); }         // layer input slice
__host__ __device__ constexpr int layer_bytes(int l) { return wm_bytes(l) + wh_bytes(l) + hs_bytes(l) + al(out_t(l) * 4); }
__host__ __device__ constexpr int layer_base(int l) {
    int o = 0;
    for (int k = 1; k < l; ++k) o += layer_bytes(k);
    return o;
}
#define OFF_DZ (layer_base(LL + 1))
#define OFF_RED (OFF_DZ + al(BP * DZS * 2))
#define OFF_ZL (OFF_RED + al(64 * BP * 4))
#define OFF_XQ (OFF_ZL + al(BP * 16 * 4))
#define OFF_LAB (OFF_XQ + al(2 * BP * TA1))
#define OFF_STAT (OFF_LAB + al(2 * BP * 4))
#define SMEM_BYTES (OFF_STAT + 128)

extern "C" __constant__ int ft_smem_bytes = SMEM_BYTES;
extern "C" __constant__ int ft_grid = grid_size();
extern "C" __constant__ int ft_amax = AMAX;
static_assert(NR <= grid_size(), "one reducer CTA per chunk");

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

// ---- flags: release after the tile's global writes, acquire before reading a producer's output ----
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

// Every thread's writes of this phase are done (bar.sync), then thread 0 publishes them with a release store
// (cumulative over the writes the barrier ordered before it: the pattern of CUTLASS's GenericBarrier).
// FT_SCFENCE=1 adds __threadfence() (fence.sc.gpu) before it, as v1 was first measured.
#ifndef FT_SCFENCE
#define FT_SCFENCE 0
#endif
__device__ __forceinline__ void publish(u32* flag, u32 seq) {
    __syncthreads();
    if (threadIdx.x == 0) {
#if FT_SCFENCE
        __threadfence();
#endif
        st_release(flag, seq);
    }
}

// Wait until the `count` producer tiles idx(j) = base + (j / r) * stride + j % r have published `seq`.
// Warp 0 polls (one flag a lane); a CTA barrier then orders the whole CTA's reads after the acquires.
// A wait longer than 2 s means a bug (or a CTA that never became resident): trap rather than hang the GPU.
__device__ __noinline__ void wait_tiles(const u32* flags, int count, int r, int stride, int base, u32 seq) {
    if (threadIdx.x < 32) {
        for (int j = threadIdx.x; j < count; j += 32) {
            const u32* f = flags + base + (j / r) * stride + j % r;
            if (ld_acquire(f) < seq) {
                const u64 t0 = globaltimer();
                int spins = 0;
                while (ld_acquire(f) < seq) {
                    if (++spins == 4096) {
                        spins = 0;
                        if (globaltimer() - t0 > 2000000000ull) __trap();
                    }
                }
            }
        }
        __syncwarp();
    }
    __syncthreads();
}

// ---- tile GEMMs (8 warps; m16n8k16, fp32 accumulation) ----

// dst[r][b0 + o] = (hs @ W)[r][o] (+ bias[o]) for the tile: M = B', N = OT, K = IT. B from the W^T copy
// [o][i] (ldmatrix, no transpose). Warps split N; when OT < 64 they also split K and reduce in `red`.
template <int IT, int OT>
__device__ __forceinline__ void tile_forward(const elem_t* hs, const elem_t* wh, float* red, const float* bias,
                                             float* dst, int dst_stride)
{
    constexpr int NT = OT / 8, KT = IT / 16;
    constexpr int NPW = NT >= NWARP ? NT / NWARP : 1;
    constexpr int KSPLIT = NT >= NWARP ? 1 : NWARP / NT;
    static_assert(NT % NWARP == 0 || NWARP % NT == 0, "n-tiles and warps");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nfirst = NT >= NWARP ? warp * NPW : warp % NT;
    const int kgrp = NT >= NWARP ? 0 : warp / NT;
    float acc[MT][NPW][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NPW; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;
#pragma unroll 4
    for (int ks = kgrp; ks < KT; ks += KSPLIT) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldsm_x4(a[mt], smem_u32(hs + (mt * 16 + (lane & 15)) * (IT + 8) + ks * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int j = 0; j < NPW; ++j) {
            u32 b0, b1;
            ldsm_x2(b0, b1, smem_u32(wh + ((nfirst + j) * 8 + (lane & 7)) * (IT + 8) + ks * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma16816(acc[mt][j], a[mt], b0, b1);
        }
    }
    if (KSPLIT == 1) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NPW; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = mt * 16 + g + 8 * h, o = (nfirst + j) * 8 + 2 * t;
                    float2 v = make_float2(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
                    if (bias) { v.x += bias[o]; v.y += bias[o + 1]; }
                    *reinterpret_cast<float2*>(dst + (size_t)r * dst_stride + o) = v;
                }
    } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                red[(kgrp * BP + mt * 16 + g + (e >> 1) * 8) * OT + nfirst * 8 + 2 * t + (e & 1)] = acc[mt][0][e];
        __syncthreads();
        for (int i = threadIdx.x; i < BP * OT; i += NTHR) {
            const int r = i / OT, o = i % OT;
            float z = bias ? bias[o] : 0.f;
#pragma unroll
            for (int k = 0; k < KSPLIT; ++k) z += red[(k * BP + r) * OT + o];
            dst[(size_t)r * dst_stride + o] = z;
        }
    }
}

// dH[r][i] = sum_o dz[r][o] W^T[o][i], masked by [hs[r][i] > 0]: M = B', N = IT, K = OT (old W: call before
// the update). B[k=o][n=i] = wh[o][i] is row-major [k][n], so ldmatrix.trans. Writes fp32 partials (Q) or the
// complete fp16 dZ (last layer).
template <int IT, int OT, bool HALF_OUT>
__device__ __forceinline__ void tile_dh(const elem_t* dzs, const elem_t* wh, const elem_t* hs, void* dst, int dst_stride)
{
    constexpr int NTI = IT / 8, KT = OT / 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 a[KT][MT][4];
#pragma unroll
    for (int ks = 0; ks < KT; ++ks)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldsm_x4(a[ks][mt], smem_u32(dzs + (mt * 16 + (lane & 15)) * DZS + ks * 16 + (lane >> 4) * 8));
    for (int nt = warp; nt < NTI; nt += NWARP) {
        const int n0 = nt * 8;
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KT; ++ks) {
            u32 b0, b1;
            ldsm_x2_t(b0, b1, smem_u32(wh + (ks * 16 + (lane & 15)) * (IT + 8) + n0));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma16816(acc[mt], a[ks][mt], b0, b1);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mt * 16 + g + 8 * h, i = n0 + 2 * t;
                const float2 hv = unpack2(*reinterpret_cast<const u32*>(hs + r * (IT + 8) + i));
                const float v0 = hv.x > 0.f ? acc[mt][2 * h] : 0.f;       // ReLU'(z) = [h > 0]
                const float v1 = hv.y > 0.f ? acc[mt][2 * h + 1] : 0.f;
                if (HALF_OUT)
                    *reinterpret_cast<u32*>(reinterpret_cast<elem_t*>(dst) + (size_t)r * dst_stride + i) = pack2(v0, v1);
                else
                    *reinterpret_cast<float2*>(reinterpret_cast<float*>(dst) + (size_t)r * dst_stride + i) = make_float2(v0, v1);
            }
    }
}

// W^T[o][i] -= scale * (dz^T @ hs)[o][i]: M = OT, N = IT, K = B'. A = dz^T from the [r][o] tile with
// ldmatrix.trans; B = hs [r][i] (row-major [k][n]) with ldmatrix.trans. Updates the fp32 master and its copy.
template <int IT, int OT>
__device__ __forceinline__ void tile_update(const elem_t* dzs, const elem_t* hs, float* wm, elem_t* wh, float scale)
{
    constexpr int NTI = IT / 8, MTO = OT / 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 a[MTO][MT][4];
#pragma unroll
    for (int mo = 0; mo < MTO; ++mo)
#pragma unroll
        for (int kk = 0; kk < MT; ++kk)
            ldsm_x4_t(a[mo][kk], smem_u32(dzs + (kk * 16 + (lane & 7) + ((lane >> 4) << 3)) * DZS + mo * 16 + ((lane >> 3) & 1) * 8));
    for (int nt = warp; nt < NTI; nt += NWARP) {
        const int n0 = nt * 8;
        u32 hb[MT][2];
#pragma unroll
        for (int kk = 0; kk < MT; ++kk)
            ldsm_x2_t(hb[kk][0], hb[kk][1], smem_u32(hs + (kk * 16 + (lane & 15)) * (IT + 8) + n0));
#pragma unroll
        for (int mo = 0; mo < MTO; ++mo) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < MT; ++kk) mma16816(acc, a[mo][kk], hb[kk][0], hb[kk][1]);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int o = mo * 16 + g + 8 * h, i = n0 + 2 * t;
                float2* w = reinterpret_cast<float2*>(wm + o * (IT + 4) + i);
                float2 v = *w;
                v.x -= scale * acc[2 * h];
                v.y -= scale * acc[2 * h + 1];
                *w = v;
                *reinterpret_cast<u32*>(wh + o * (IT + 8) + i) = pack2(v.x, v.y);
            }
        }
    }
}

struct Ctx {
    unsigned char* smem;
    const u64* wptr;
    float* P;          // [2][LL][AMAX][B'][H] forward partials
    float* Q;          // [2][LL][FT_B][B'][H] backward partials (masked dH)
    elem_t* DZ;        // [2][B'][H] dZ_NL (complete)
    elem_t* HC;        // [2][LL][B'][H] complete activations h_l (reduce phases)
    elem_t* DZC;       // [2][LL][B'][H] complete dZ_l (reduce phases)
    u32* flags;        // [4][LL][G]: forward tiles, backward tiles, forward reduces, backward reduces
    int c;
};

__device__ __forceinline__ float* wm_of(const Ctx& k, int l) { return reinterpret_cast<float*>(k.smem + layer_base(l)); }
__device__ __forceinline__ elem_t* wh_of(const Ctx& k, int l) { return reinterpret_cast<elem_t*>(k.smem + layer_base(l) + wm_bytes(l)); }
__device__ __forceinline__ elem_t* hs_of(const Ctx& k, int l) {
    return reinterpret_cast<elem_t*>(k.smem + layer_base(l) + wm_bytes(l) + wh_bytes(l));
}
__device__ __forceinline__ float* bias_of(const Ctx& k, int l) {
    return reinterpret_cast<float*>(k.smem + layer_base(l) + wm_bytes(l) + wh_bytes(l) + hs_bytes(l));
}
__device__ __forceinline__ float* P_of(const Ctx& k, int buf, int l, int a) {
    return k.P + (((size_t)(buf * LL + (l - 1)) * AMAX + a) * BP) * H;
}
__device__ __forceinline__ float* Q_of(const Ctx& k, int buf, int l, int b) {
    return k.Q + (((size_t)(buf * LL + (l - 1)) * FT_B + b) * BP) * H;
}
__device__ __forceinline__ u32* fflag(const Ctx& k, int l) { return k.flags + (l - 1) * G; }
__device__ __forceinline__ u32* bflag(const Ctx& k, int l) { return k.flags + (LL + l - 1) * G; }
__device__ __forceinline__ u32* rflag(const Ctx& k, int l) { return k.flags + (2 * LL + l - 1) * G; }
__device__ __forceinline__ u32* sflag(const Ctx& k, int l) { return k.flags + (3 * LL + l - 1) * G; }
__device__ __forceinline__ elem_t* HC_of(const Ctx& k, int buf, int l) { return k.HC + (size_t)(buf * LL + (l - 1)) * BP * H; }
__device__ __forceinline__ elem_t* DZC_of(const Ctx& k, int buf, int l) { return k.DZC + (size_t)(buf * LL + (l - 1)) * BP * H; }

// Reduce phases: CTA c < NR owns columns [c*CW, c*CW + CW) of h_l (forward) or dZ_l (backward).
//   h_l[:, chunk]  = relu(sum_a'' P_l[a''][:, chunk])        from the n_a(l) tiles of layer l in that column tile
//   dZ_l[:, chunk] = sum_b'' Q_{l+1}[b''][:, chunk]          from the FT_B tiles of layer l+1 in that row tile
// Bytes a CTA: n x B' x CW x 4 read (8 KB forward, 16 KB backward for mlp:1024x3), B' x CW x 2 written.
template <int l>
__device__ void reduce_fwd(const Ctx& k, int buf, u32 seq) {
    if (k.c >= NR) return;
    const int col0 = k.c * FT_CW;
    wait_tiles(fflag(k, l), n_a(l), 1, n_b(l), col0 / out_t(l), seq);
    const float* src = P_of(k, buf, l, 0) + col0;
    elem_t* dst = HC_of(k, buf, l) + col0;
    for (int e = threadIdx.x; e < BP * FT_CW / 2; e += NTHR) {
        const int r = e / (FT_CW / 2), j = (e % (FT_CW / 2)) * 2;
        float2 v[n_a(l)];
#pragma unroll
        for (int p = 0; p < n_a(l); ++p) v[p] = __ldcg(reinterpret_cast<const float2*>(src + ((size_t)p * BP + r) * H + j));
        float2 z = v[0];
#pragma unroll
        for (int p = 1; p < n_a(l); ++p) { z.x += v[p].x; z.y += v[p].y; }
        *reinterpret_cast<u32*>(dst + (size_t)r * H + j) = pack2(fmaxf(z.x, 0.f), fmaxf(z.y, 0.f));
    }
    publish(rflag(k, l) + k.c, seq);
}
template <int l>
__device__ void reduce_bwd(const Ctx& k, int buf, u32 seq) {
    if (k.c >= NR) return;
    const int col0 = k.c * FT_CW;
    wait_tiles(bflag(k, l + 1), FT_B, FT_B, 0, (col0 / TA) * FT_B, seq);
    const float* src = Q_of(k, buf, l + 1, 0) + col0;
    elem_t* dst = DZC_of(k, buf, l) + col0;
    for (int e = threadIdx.x; e < BP * FT_CW / 2; e += NTHR) {
        const int r = e / (FT_CW / 2), j = (e % (FT_CW / 2)) * 2;
        float2 v[FT_B];
#pragma unroll
        for (int p = 0; p < FT_B; ++p) v[p] = __ldcg(reinterpret_cast<const float2*>(src + ((size_t)p * BP + r) * H + j));
        float2 z = v[0];
#pragma unroll
        for (int p = 1; p < FT_B; ++p) { z.x += v[p].x; z.y += v[p].y; }
        *reinterpret_cast<u32*>(dst + (size_t)r * H + j) = pack2(z.x, z.y);
    }
    publish(sflag(k, l) + k.c, seq);
}

// Copy a complete fp16/bf16 slice [B'][W] (W a multiple of 8) from global (L2) into shared memory.
template <int W>
__device__ __forceinline__ void load_slice(elem_t* dst, int dst_stride, const elem_t* src) {
    for (int q = threadIdx.x; q < BP * W / 8; q += NTHR) {
        const int r = q / (W / 8), i = (q % (W / 8)) * 8;
        *reinterpret_cast<uint4*>(dst + r * dst_stride + i) = __ldcg(reinterpret_cast<const uint4*>(src + (size_t)r * H + i));
    }
}

// Load (dir = 0) or store (dir = 1) this CTA's tile of layer l between the global fp32 masters and shared memory.
template <int l>
__device__ void move_tile(const Ctx& k, int dir) {
    constexpr int IT = in_t(l), OT = out_t(l), NB = n_b(l), IP = in_p(l);
    if (k.c >= tiles(l)) return;
    const int a = k.c / NB, b = k.c % NB;
    float* wt = reinterpret_cast<float*>(k.wptr[2 * (l - 1)]);
    float* bias = reinterpret_cast<float*>(k.wptr[2 * (l - 1) + 1]);
    float* wm = wm_of(k, l);
    elem_t* wh = wh_of(k, l);
    float* bs = bias_of(k, l);
    for (int q = threadIdx.x; q < OT * IT / 4; q += NTHR) {
        const int o = q / (IT / 4), i = (q % (IT / 4)) * 4;
        float4* gp = reinterpret_cast<float4*>(wt + (size_t)(b * OT + o) * IP + a * IT + i);
        float* sp = wm + o * (IT + 4) + i;
        if (dir == 0) {
            const float4 v = *gp;
            sp[0] = v.x; sp[1] = v.y; sp[2] = v.z; sp[3] = v.w;
            *reinterpret_cast<uint2*>(wh + o * (IT + 8) + i) = make_uint2(pack2(v.x, v.y), pack2(v.z, v.w));
        } else {
            *gp = make_float4(sp[0], sp[1], sp[2], sp[3]);
        }
    }
    if (a == 0)
        for (int o = threadIdx.x; o < OT; o += NTHR) {
            if (dir == 0) bs[o] = bias[b * OT + o];
            else bias[b * OT + o] = bs[o];
        }
}

// Forward of layer l (1 <= l <= LL) for this CTA's tile.
template <int l>
__device__ void fwd_layer(const Ctx& k, int buf, u32 seq, const u8* xq) {
    constexpr int IT = in_t(l), OT = out_t(l), NB = n_b(l);
    if (k.c >= tiles(l)) return;
    const int a = k.c / NB, b = k.c % NB;
    elem_t* hs = hs_of(k, l);
    if constexpr (l == 1) {
        // x = pixel/255 in the operand type (the rounding of rung 7's gather)
        cp_async_wait<0>();
        __syncthreads();
        for (int q = threadIdx.x; q < BP * IT / 4; q += NTHR) {
            const int r = q / (IT / 4), i = (q % (IT / 4)) * 4;
            const u32 v = *reinterpret_cast<const u32*>(xq + r * TA1 + i);
            const float s = 1.0f / 255.0f;
            *reinterpret_cast<uint2*>(hs + r * (IT + 8) + i) =
                make_uint2(pack2((float)(v & 0xff) * s, (float)((v >> 8) & 0xff) * s),
                           pack2((float)((v >> 16) & 0xff) * s, (float)(v >> 24) * s));
        }
    } else {
        // the reducers of the chunks of h_{l-1} that make up this tile's input slice
        wait_tiles(rflag(k, l - 1), IT / FT_CW, IT / FT_CW, 0, a * IT / FT_CW, seq);
        load_slice<IT>(hs, IT + 8, HC_of(k, buf, l - 1) + a * IT);
    }
    __syncthreads();
    float* red = reinterpret_cast<float*>(k.smem + OFF_RED);
    tile_forward<IT, OT>(hs, wh_of(k, l), red, a == 0 ? bias_of(k, l) : nullptr, P_of(k, buf, l, a) + b * OT, H);
    publish(fflag(k, l) + k.c, seq);
}

// Backward of a hidden layer l (1 <= l <= NL): gather dz_l[:, b], Q_l partial (l >= 2), the SGD update.
template <int l>
__device__ void bwd_layer(const Ctx& k, int buf, u32 seq, float scale) {
    constexpr int IT = in_t(l), OT = TB, NB = FT_B;
    if (k.c >= tiles(l)) return;
    const int a = k.c / NB, b = k.c % NB;
    elem_t* dzs = reinterpret_cast<elem_t*>(k.smem + OFF_DZ);
    const int a_up = b * OT / TA;       // the tile row of layer l+1 whose inputs are this tile's outputs
    if constexpr (l == NL) {
        wait_tiles(bflag(k, LL), 1, 1, 0, a_up, seq);
        load_slice<OT>(dzs, DZS, k.DZ + (size_t)buf * BP * H + b * OT);
    } else {
        wait_tiles(sflag(k, l), OT / FT_CW, OT / FT_CW, 0, b * OT / FT_CW, seq);
        load_slice<OT>(dzs, DZS, DZC_of(k, buf, l) + b * OT);
    }
    __syncthreads();
    elem_t* hs = hs_of(k, l);
    if constexpr (l >= 2) {
        tile_dh<IT, OT, false>(dzs, wh_of(k, l), hs, Q_of(k, buf, l, b) + a * IT, H);
        publish(bflag(k, l) + k.c, seq);    // ends with a CTA barrier: W is read by tile_dh before the update
    }
    tile_update<IT, OT>(dzs, hs, wm_of(k, l), wh_of(k, l), scale);
    if (a == 0) {
        float* bs = bias_of(k, l);
        for (int o = threadIdx.x; o < OT; o += NTHR) {
            float s = 0.f;
            for (int r = 0; r < BP; ++r) s += from_elem(dzs[r * DZS + o]);
            bs[o] -= scale * s;
        }
    }
    __syncthreads();   // dzs is rewritten by the next phase
}

// Last layer: logits from every tile's partials, softmax / loss / accuracy / g (every last-layer CTA computes
// them for all rows), dZ_NL[:, a] (complete), then the update of W_L[a] (and b_L in tile 0).
__device__ void bwd_last(const Ctx& k, int buf, u32 seq, float scale, int rows, const int* lab,
                         float* stat_loss, int* stat_ok, int s) {
    constexpr int IT = TA;
    if (k.c >= tiles(LL)) return;
    const int a = k.c;
    wait_tiles(fflag(k, LL), FT_A, FT_A, 0, 0, seq);
    float* zl = reinterpret_cast<float*>(k.smem + OFF_ZL);
    elem_t* dzs = reinterpret_cast<elem_t*>(k.smem + OFF_DZ);
    for (int i = threadIdx.x; i < BP * 16; i += NTHR) {
        const int r = i >> 4, o = i & 15;
        float z = 0.f;
#pragma unroll
        for (int p = 0; p < FT_A; ++p) z += __ldcg(P_of(k, buf, LL, p) + (size_t)r * H + o);
        zl[i] = z;
    }
    __syncthreads();
    float lsum = 0.f;
    int okc = 0;
    for (int r = threadIdx.x; r < BP; r += NTHR) {
        float z[10];
        float mx = FT_NEG_INF;
        int best = 0;
#pragma unroll
        for (int c = 0; c < 10; ++c) {
            z[c] = zl[r * 16 + c];
            if (z[c] > mx) { mx = z[c]; best = c; }
        }
        float se = 0.f;
#pragma unroll
        for (int c = 0; c < 10; ++c) se += __expf(z[c] - mx);
        const bool live = r < rows;
        const int y = live ? lab[r] : -1;
        float zy = 0.f;
#pragma unroll
        for (int c = 0; c < 10; ++c) zy = (c == y) ? z[c] : zy;
        if (live) {
            lsum += __logf(se) - (zy - mx);
            okc += (best == y);
        }
        const float inv = 1.0f / se;
#pragma unroll
        for (int c = 0; c < 16; c += 2) {
            const float g0 = (live && c < 10) ? __expf(z[c] - mx) * inv - (c == y) : 0.f;
            const float g1 = (live && c + 1 < 10) ? __expf(z[c + 1] - mx) * inv - (c + 1 == y) : 0.f;
            *reinterpret_cast<u32*>(dzs + r * DZS + c) = pack2(g0, g1);
        }
    }
    // step statistics (CTA 0): rows live in warps 0 and 1 (B' <= 64)
    float* st = reinterpret_cast<float*>(k.smem + OFF_STAT);
    if (k.c == 0 && threadIdx.x < 64) {
        lsum = warp_sum(lsum);
        okc = __reduce_add_sync(0xffffffffu, okc);
        if ((threadIdx.x & 31) == 0) { st[2 * (threadIdx.x >> 5)] = lsum; st[2 * (threadIdx.x >> 5) + 1] = (float)okc; }
    }
    __syncthreads();   // also orders the g tile before tile_dh reads it
    if (k.c == 0 && threadIdx.x == 0) {
        stat_loss[s] = st[0] + st[2];
        stat_ok[s] = (int)(st[1] + st[3]);
    }
    elem_t* hs = hs_of(k, LL);
    tile_dh<IT, 16, true>(dzs, wh_of(k, LL), hs, k.DZ + (size_t)buf * BP * H + a * IT, H);
    publish(bflag(k, LL) + k.c, seq);
    tile_update<IT, 16>(dzs, hs, wm_of(k, LL), wh_of(k, LL), scale);
    if (a == 0) {
        float* bs = bias_of(k, LL);
        for (int o = threadIdx.x; o < 16; o += NTHR) {
            float sum = 0.f;
            for (int r = 0; r < BP; ++r) sum += from_elem(dzs[r * DZS + o]);
            bs[o] -= scale * sum;
        }
    }
    __syncthreads();
}

// Prefetch the pixels of this CTA's layer-1 input slice: 7 B' copies of 16 bytes (up to 448 for B' = 64, so up to
// two a thread: q = tid and tid + 256); copy q takes 16 bytes of row q / 7, whose example index idx[i] (-1: padding
// row) the caller loaded earlier with row_indices (the loads' latency hides behind other work).
#define PF (BP * 7 > NTHR ? 2 : 1)
__device__ __forceinline__ void row_indices(int idx[PF], const int* order, int base, int rows) {
#pragma unroll
    for (int i = 0; i < PF; ++i) {
        const int q = threadIdx.x + i * NTHR;
        idx[i] = (q < BP * 7 && q / 7 < rows) ? order[base + q / 7] : -1;
    }
}
__device__ __forceinline__ void prefetch_pixels(const u8* X, const int idx[PF], u8* xq, int a1) {
#pragma unroll
    for (int i = 0; i < PF; ++i) {
        const int q = threadIdx.x + i * NTHR;
        if (q < BP * 7) {
            const int r = q / 7, c16 = q % 7;
            if (idx[i] >= 0) cp_async16(smem_u32(xq + r * TA1 + c16 * 16), X + (size_t)idx[i] * 784 + a1 * TA1 + c16 * 16);
            else *reinterpret_cast<uint4*>(xq + r * TA1 + c16 * 16) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    cp_async_commit();
}

template <int l>
__device__ __forceinline__ void forward_chain(const Ctx& k, int buf, u32 seq) {   // layers l..NL, then the last
    if constexpr (l <= NL) {
        fwd_layer<l>(k, buf, seq, nullptr);
        reduce_fwd<l>(k, buf, seq);
        forward_chain<l + 1>(k, buf, seq);
    }
}
template <int l>
__device__ __forceinline__ void backward_chain(const Ctx& k, int buf, u32 seq, float scale) {   // layers l..1
    if constexpr (l >= 1) {
        if constexpr (l < NL) reduce_bwd<l>(k, buf, seq);
        bwd_layer<l>(k, buf, seq, scale);
        backward_chain<l - 1>(k, buf, seq, scale);
    }
}

// One launch trains `steps` steps; seq0 = steps trained before this launch (the flags count steps).
extern "C" __global__ void __launch_bounds__(NTHR, 1)
grid_epoch(const u8* __restrict__ X, const int* __restrict__ Y, const int* __restrict__ order,
           int n, int batch, int steps, float lr, unsigned seq0,
           const u64* __restrict__ wptr,      // [2*LL]: W^T_1, b_1, ..., W^T_L, b_L (fp32 masters, padded), in/out
           float* __restrict__ P, float* __restrict__ Q, elem_t* __restrict__ DZ, elem_t* __restrict__ HC,
           elem_t* __restrict__ DZC, u32* __restrict__ flags,
           unsigned* __restrict__ done, float* __restrict__ stat_loss, int* __restrict__ stat_ok,
           double* __restrict__ out,           // [2 + steps + 1]: loss sum, correct, step means, completion flag
           double flag, long long* __restrict__ prof)
{
    extern __shared__ __align__(128) unsigned char smem[];
    Ctx k{smem, wptr, P, Q, DZ, HC, DZC, flags, (int)blockIdx.x};
    u8* xq0 = smem + OFF_XQ;
    int* lab = reinterpret_cast<int*>(smem + OFF_LAB);
    const bool has1 = k.c < tiles(1);
    const int a1 = has1 ? k.c / FT_B : 0;
    if (has1 && steps > 0) {
        int idx[PF];
        row_indices(idx, order, 0, min(batch, n));
        prefetch_pixels(X, idx, xq0, a1);
    }
    move_tile<1>(k, 0);
    if constexpr (LL >= 2) move_tile<2>(k, 0);
    if constexpr (LL >= 3) move_tile<3>(k, 0);
    if constexpr (LL >= 4) move_tile<4>(k, 0);
    if constexpr (LL >= 5) move_tile<5>(k, 0);
    if constexpr (LL >= 6) move_tile<6>(k, 0);
    if constexpr (LL >= 7) move_tile<7>(k, 0);
    __syncthreads();
#if FT_PROF
    long long pacc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long long plast = clock64();
#define PROF_T(i) do { long long c_ = clock64(); pacc[i] += c_ - plast; plast = c_; } while (0)
#else
#define PROF_T(i) do {} while (0)
#endif

    for (int s = 0; s < steps; ++s) {
        const int base = s * batch, rows = min(batch, n - base);
        const u32 seq = seq0 + s + 1;
        const int buf = (seq0 + s) & 1;
        const float scale = lr / rows;
        // labels of this step (last-layer CTAs) and the example indices of the next step's rows: loaded now,
        // used later (the loads' latency hides behind the forward)
        int my_label = 0;
        if (k.c < tiles(LL) && threadIdx.x < rows) my_label = Y[order[base + threadIdx.x]];
        int next_idx[PF];
        row_indices(next_idx, order, base + batch, has1 && s + 1 < steps ? min(batch, n - base - batch) : 0);
        fwd_layer<1>(k, buf, seq, xq0 + (s & 1) * BP * TA1);    // slot s&1 of the two-slot ring holds step s
        if (has1 && s + 1 < steps) prefetch_pixels(X, next_idx, xq0 + ((s + 1) & 1) * BP * TA1, a1);
        PROF_T(0);
        reduce_fwd<1>(k, buf, seq);
        forward_chain<2>(k, buf, seq);
        PROF_T(1);
        fwd_layer<LL>(k, buf, seq, nullptr);
        PROF_T(2);
        if (k.c < tiles(LL) && threadIdx.x < BP) lab[threadIdx.x] = my_label;
        bwd_last(k, buf, seq, scale, rows, lab, stat_loss, stat_ok, s);
        PROF_T(3);
        backward_chain<NL>(k, buf, seq, scale);
        PROF_T(5);
    }
    move_tile<1>(k, 1);
    if constexpr (LL >= 2) move_tile<2>(k, 1);
    if constexpr (LL >= 3) move_tile<3>(k, 1);
    if constexpr (LL >= 4) move_tile<4>(k, 1);
    if constexpr (LL >= 5) move_tile<5>(k, 1);
    if constexpr (LL >= 6) move_tile<6>(k, 1);
    if constexpr (LL >= 7) move_tile<7>(k, 1);
#if FT_PROF
    if (threadIdx.x == 0)
        for (int i = 0; i < 8; ++i) prof[k.c * 8 + i] = pacc[i];
#endif
    // The last CTA to finish writes the epoch's statistics and then the completion flag the host spins on.
    __syncthreads();
    __shared__ unsigned last_cta;
    if (threadIdx.x == 0) {
        __threadfence();
        last_cta = (atomicAdd(done, 1u) == gridDim.x - 1);
    }
    __syncthreads();
    if (!last_cta) return;
    __threadfence();
    double wl = 0.0, wc = 0.0;
    for (int s = threadIdx.x; s < steps; s += NTHR) {
        const int rows = min(batch, n - s * batch);
        const float l = __ldcg(stat_loss + s);
        out[2 + s] = (double)l / rows;
        wl += l;
        wc += __ldcg(stat_ok + s);
    }
    double* red = reinterpret_cast<double*>(smem + OFF_RED);
    red[threadIdx.x] = wl;
    red[NTHR + threadIdx.x] = wc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double L = 0.0, Acc = 0.0;
        for (int i = 0; i < NTHR; ++i) { L += red[i]; Acc += red[NTHR + i]; }
        out[0] = L;
        out[1] = Acc;
        *done = 0u;
        __threadfence_system();
        out[2 + steps] = flag;
    }
}
