// fused_logreg.cu: rung 8 for logreg, one persistent kernel per epoch on a thread-block cluster.
//
// Version history (this file is the last; the earlier ones live in dev/cuda/ beside NOTES-fused.md,
// which has the prediction and the measured outcome of each):
//   v1  K-split over the cluster; partial logits pushed to every CTA with per-thread st.async (all-to-all,
//       35 KB into each CTA a step); every CTA does the whole softmax. Measured (H200): 2.8 ms/epoch, the
//       pushes alone ~5000 cycles a step (7 bytes/cycle), and they slow the producer's cp.async too.
//   v2  The exchange in two small hops with the bulk-copy engine (cp.async.bulk shared::cta -> shared::cluster,
//       completing on the receiver's mbarrier): reduce-scatter of the partial logits by row block (CTA r owns
//       rows [r*RPC, (r+1)*RPC): ~6 KB in), softmax of the own rows only, all-gather of g = p - onehot (fp16,
//       ~6 KB in). Next batch converted while the partials travel; two accumulators per mma chain.
//       Measured (H200): 1.94 ms/epoch, of which ~1.1 ms in the step loop (4650 cycles a step).
//   v3  Per-row loss/accuracy stores to global memory deferred past the proxy fence and the all-gather issue
//       (a fence waits for the thread's outstanding stores); only the threads that wrote g fence; per-step
//       sums kept per warp in registers so the epoch-end reduction reads 8 floats a step, not B.
//       Measured (H200): 1.43 ms of kernel an epoch (3.0 us a step, 4760 cycles: fwd 560, fence+barrier+
//       scatter issue 595, convert 850, softmax 715, gather issue+stats 665, backward 875); train_epoch's wall
//       time 1.9-2.0 ms, i.e. ~0.5 ms on the host side (launch + stream synchronization).
//   v4  Copies issued in parallel (lane 0 of warp d sends to CTA d, instead of lanes of one warp); forward
//       and backward fragments loaded up front (all ldmatrix, then the mma chains; the backward's X
//       fragments are loaded before waiting for g); the per-step loss sums moved into the exchange latency of
//       the next step; a completion flag written last into the host-mapped output (the host spins on it
//       instead of sleeping in cudaStreamSynchronize). No bulk copy to the own CTA (compute-sanitizer's memcheck
//       rejects a shared::cluster destination in the issuing CTA): the own partials are read from `mine`.
//
// The math per step (B' rows, x = pixel/255, X_int = pixels as exact integers):
//   logits = (X_int @ W16) / 255 + b ; g = softmax(logits) - onehot(y) ; W^T -= lr/(255 B') g^T @ X_int ;
//   b -= lr/B' colsum(g). Per step and cluster: 6.4 MFLOP of mma (classes padded to 16); 100 KB of pixels;
//   over DSMEM 2 * 128 rows * 48 bytes * (C-1)/C per CTA.
//
// Compile-time configuration (-D): FT_C cluster size, FT_KT k-tiles per CTA (ceil(49/C)), FT_MT m-tiles per
// batch (<= 12), FT_STAGES ring depth, FT_BF16, FT_PW producer warps, FT_PROF. (Two activation buffers always.)
// Compile alone: nvcc --ptx -arch=sm_90 fused_logreg.cu
#ifndef FT_C
#define FT_C 7
#endif
#ifndef FT_KT
#define FT_KT 7
#endif
#ifndef FT_MT
#define FT_MT 8
#endif
#ifndef FT_STAGES
#define FT_STAGES 4
#endif
#ifndef FT_PW
#define FT_PW 1
#endif
#ifndef FT_BF16
#define FT_BF16 0
#endif
#ifndef FT_PROF
#define FT_PROF 0
#endif
#include "fused_common.cuh"

#if FT_PROF
#define PROF_T(i) do { if (prof_on) { long long c_ = clock64(); pacc[i] += c_ - plast; plast = c_; } } while (0)
#else
#define PROF_T(i) do {} while (0)
#endif

#define NCW 8
#define NPW FT_PW
#define NCT (NCW * 32)
#define NTHREADS ((NCW + NPW) * 32)
#define C FT_C
#define KT FT_KT
#define MT FT_MT
#define BP (MT * 16)
#define KF (KT * 16)
#define XS (KF + 8)
#define DS 24                          // gbuf row: 16 classes + 8 (48 bytes, a multiple of 16 for the bulk copies)
#define PS 12                          // partial-logit row: 10 classes + 2 (48 bytes)
#define RPC ((BP + C - 1) / C)         // softmax rows owned by each CTA
#define NT (2 * KT)
#define NTW ((NT + 1 + NCW - 1) / NCW)
#define MTW ((MT + NCW - 1) / NCW)
#define NFEAT 784
#define NCLS 10
#define STAGES FT_STAGES
#define SMW ((4 * RPC + 31) / 32)      // warps that run the softmax (4 lanes a row)

#define A128(x) ((((x) + 127) / 128) * 128)
#define OFF_BAR 0                                     // full[S] empty[S] rs ag
#define OFF_BIAS 256                                  // float[16]
#define OFF_SX 512                                    // u8 [S][BP][KF]
#define OFF_SY A128(OFF_SX + STAGES * BP * KF)        // int [S][BP]
#define OFF_XH A128(OFF_SY + STAGES * BP * 4)         // elem [2][BP][XS]
#define OFF_WT A128(OFF_XH + 2 * BP * XS * 2)         // elem [16][XS]
#define OFF_G A128(OFF_WT + 16 * XS * 2)              // elem [BP][DS]  (all rows; own rows computed here)
#define OFF_MINE A128(OFF_G + BP * DS * 2)            // float [BP][PS] this CTA's partial logits
#define OFF_RS A128(OFF_MINE + BP * PS * 4)           // float [C][RPC][PS] partials of the own rows
#define OFF_RED A128(OFF_RS + C * RPC * PS * 4)       // double [2][NCW]
#define SMEM_BYTES (OFF_RED + 2 * NCW * 8)

extern "C" __constant__ int ft_smem_bytes = SMEM_BYTES;

__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// bytes [src, src+size) of this CTA's shared memory -> dst in CTA `rank`; its mbarrier counts the bytes
__device__ __forceinline__ void bulk_s2c(u32 dst_local, u32 src, u32 size, u32 bar_local, u32 rank) {
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(mapa(dst_local, rank)), "r"(src), "r"(size), "r"(mapa(bar_local, rank)) : "memory");
}
__device__ __forceinline__ int rows_of(int r) { return max(0, min(BP, (r + 1) * RPC) - r * RPC); }

extern "C" __global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(NTHREADS, 1)
logreg_epoch(const u8* __restrict__ X, const int* __restrict__ Y, const int* __restrict__ order,
             int n, int B, int steps, float lr,
             float* __restrict__ Wt, float* __restrict__ bias,
             float* __restrict__ row_loss,    // scratch [steps][C][SMW][2]: per-step loss/correct sums of each warp
             u8* __restrict__ row_ok,         // unused (v1/v2 per-example flags)
             double* __restrict__ out,        // [2 + steps + 1]: ..., and last the completion flag (= flag)
             double flag,
             long long* __restrict__ prof,
             // a sweep (many models at once): cluster m trains model m; each per-model argument above is model
             // 0's and model m's lies m strides (elements) further; a single run: lrs = nullptr, strides unused
             const float* __restrict__ lrs, long long s_order, long long s_w, long long s_rows, long long s_out)
{
    extern __shared__ __align__(128) unsigned char smem[];
    u64* bar_full = reinterpret_cast<u64*>(smem + OFF_BAR);
    u64* bar_empty = bar_full + STAGES;
    u64* bar_rs = bar_empty + STAGES;
    u64* bar_ag = bar_rs + 1;
    float* bias_s = reinterpret_cast<float*>(smem + OFF_BIAS);
    u8* sx = smem + OFF_SX;
    int* sy = reinterpret_cast<int*>(smem + OFF_SY);
    elem_t* xh = reinterpret_cast<elem_t*>(smem + OFF_XH);
    elem_t* wt16 = reinterpret_cast<elem_t*>(smem + OFF_WT);
    elem_t* gbuf = reinterpret_cast<elem_t*>(smem + OFF_G);
    float* mine = reinterpret_cast<float*>(smem + OFF_MINE);
    float* rs = reinterpret_cast<float*>(smem + OFF_RS);
    double* red = reinterpret_cast<double*>(smem + OFF_RED);

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const u32 rank = cluster_rank();
    {
        const int model = blockIdx.x / C;
        if (lrs != nullptr) lr = lrs[model];
        order += model * s_order;
        Wt += model * s_w;
        bias += model * s_w / NFEAT;        // [16] a model beside W^T's [16][784]
        row_loss += model * s_rows;
        out += model * s_out;
        prof += (size_t)model * C * 32;
    }
    const int kt0 = rank * KT;
    const int ktn = min(KT, NFEAT / 16 - kt0);
    const int r_lo = rank * RPC, my_rows = rows_of(rank);
    // per-step partial sums (loss, correct) of each softmax warp of each CTA: [steps][C][SMW][2] in row_loss
    float* step_part = row_loss + (size_t)rank * SMW * 2;   // index ((s * C) ... ) via the stride below
    const u32 tx_rs = (C - 1) * my_rows * PS * 4;         // every other CTA sends us its partials of our rows
    const u32 tx_ag = (BP - my_rows) * DS * 2;            // every other CTA sends us g of its rows

    if (tid < STAGES) {
        mbar_init(smem_u32(&bar_full[tid]), NPW * 32);
        mbar_init(smem_u32(&bar_empty[tid]), 1);
    }
    if (tid == 0) {
        mbar_init(smem_u32(bar_rs), 1);
        mbar_init(smem_u32(bar_ag), 1);
        mbar_arrive_expect_tx(smem_u32(bar_rs), tx_rs);
        mbar_arrive_expect_tx(smem_u32(bar_ag), tx_ag);
    }
    fence_mbar_init();
    for (int i = tid; i < 2 * BP * XS / 2; i += NTHREADS) reinterpret_cast<u32*>(xh)[i] = 0u;
    for (int i = tid; i < BP * DS / 2; i += NTHREADS) reinterpret_cast<u32*>(gbuf)[i] = 0u;
    for (int i = tid; i < BP * PS; i += NTHREADS) mine[i] = 0.f;
    for (int i = tid; i < 16 * XS / 2; i += NTHREADS) {
        const int c = i / (XS / 2), f = 2 * (i % (XS / 2));
        const float w0 = (f < ktn * 16) ? Wt[c * NFEAT + kt0 * 16 + f] : 0.f;
        const float w1 = (f + 1 < ktn * 16) ? Wt[c * NFEAT + kt0 * 16 + f + 1] : 0.f;
        reinterpret_cast<u32*>(wt16)[i] = pack2(w0, w1);
    }
    if (tid < 16) bias_s[tid] = bias[tid];
    cluster_sync_all();
#if FT_PROF
    const bool prof_on = (tid == 0) || (tid == NCT);
    long long pacc[16] = {};
    long long plast = clock64();
#endif

    if (warp >= NCW) {
        // ================= producer warp(s) (as v1) =================
        const int pt = tid - NCT;
        for (int j = 0; j < steps; ++j) {
            const int st = j % STAGES;
            mbar_wait(smem_u32(&bar_empty[st]), ((j / STAGES) & 1) ^ 1);
            PROF_T(0);
            const int base = j * B;
            const int rows = min(B, n - base);
            for (int r0 = 0; r0 < rows; r0 += NPW * 32 * 4) {
                int idx[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int r = r0 + u * NPW * 32 + pt;
                    idx[u] = (r < rows) ? order[base + r] : -1;
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int r = r0 + u * NPW * 32 + pt;
                    if (idx[u] < 0) continue;
                    const u8* src = X + (size_t)idx[u] * NFEAT + kt0 * 16;
                    const u32 dst = smem_u32(sx + ((size_t)st * BP + r) * KF);
                    for (int c = 0; c < ktn; ++c) cp_async16(dst + c * 16, src + c * 16);
                    cp_async4(smem_u32(&sy[st * BP + r]), Y + idx[u]);
                }
            }
            cp_async_mbar_arrive(smem_u32(&bar_full[st]));
            PROF_T(1);
        }
    } else {
        // ================= consumer warps =================
        const int g = lane >> 2, t = lane & 3;
        float wm[NTW][4];
        float bm0 = 0.f, bm1 = 0.f;
#pragma unroll
        for (int i = 0; i < NTW; ++i) {
            const int j = warp + NCW * i;
            const int f = kt0 * 16 + j * 8 + 2 * t;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = g + (e >> 1) * 8;
                const int ff = f + (e & 1);
                wm[i][e] = (j < 2 * ktn && ff < NFEAT) ? Wt[c * NFEAT + ff] : 0.0f;
            }
            if (j == NT) { bm0 = bias[g]; bm1 = bias[g + 8]; }
        }
        // softmax mapping: 4 lanes a row, own rows only (warps < SMW)
        const int srow = tid >> 2;                      // 0 .. RPC-1 when valid
        const bool sm_valid = (warp < SMW) && (srow < my_rows);
        const int grow = r_lo + srow;                   // global row in the batch

        // convert stage `st` into activation buffer `xb` (exact integers), labels of the own softmax rows
        auto convert = [&](int st, elem_t* xb) -> int {
            const u8* sxs = sx + (size_t)st * BP * KF;
            const int nch = BP * ktn;
            for (int q = tid; q < nch; q += NCT) {
                const int r = q / ktn, c = q - r * ktn;
                const uint4 v = *reinterpret_cast<const uint4*>(sxs + r * KF + c * 16);
                uint4 lo, hi;
                bytes4_to_elem(v.x, lo.x, lo.y);
                bytes4_to_elem(v.y, lo.z, lo.w);
                bytes4_to_elem(v.z, hi.x, hi.y);
                bytes4_to_elem(v.w, hi.z, hi.w);
                uint4* d = reinterpret_cast<uint4*>(xb + r * XS + c * 16);
                d[0] = lo;
                d[1] = hi;
            }
            return sm_valid ? sy[st * BP + grow] : 0;
        };

        // prologue: step 0's batch
        int ylab = 0;
        bool pend = false;
        float pend_loss = 0.f, pend_ok = 0.f;
        // per-step loss/accuracy: warp sums of the softmax warps, one store per warp and step
        auto flush_stats = [&](int s_done) {
            if (warp < SMW) {
                const float wl = warp_sum(pend ? pend_loss : 0.f);
                const float wc = warp_sum(pend ? pend_ok : 0.f);
                if (lane == 0) {
                    step_part[((size_t)s_done * C * SMW + warp) * 2] = wl;
                    step_part[((size_t)s_done * C * SMW + warp) * 2 + 1] = wc;
                }
                pend = false;
            }
        };
        if (steps > 0) {
            mbar_wait(smem_u32(&bar_full[0]), 0);
            ylab = convert(0, xh);
            named_sync(1, NCT);
            if (tid == 0) mbar_arrive(smem_u32(&bar_empty[0]));
        }
        const float inv255 = 1.0f / 255.0f;

        for (int s = 0; s < steps; ++s) {
            const int rows = min(B, n - s * B);
            const elem_t* xb = xh + (s & 1) * BP * XS;
            PROF_T(0);

            // ---- 1. partial logits for all rows, into `mine`; reduce-scatter by row block (bulk copies) ----
#pragma unroll
            for (int i = 0; i < MTW; ++i) {
                const int mt = warp + NCW * i;
                if (mt >= MT) break;
                float acc[2][2][4] = {};   // [k parity][n-tile]: two independent chains per n-tile
                const u32 a_base = smem_u32(xb + (mt * 16 + (lane & 15)) * XS + (lane >> 4) * 8);
                const u32 b_base = smem_u32(wt16 + (((lane >> 4) << 3) + (lane & 7)) * XS + ((lane >> 3) & 1) * 8);
                u32 a[KT][4], b[KT][4];    // every fragment first: the ldmatrix latencies overlap
#pragma unroll
                for (int kt = 0; kt < KT; ++kt) {
                    ldsm_x4(a[kt], a_base + kt * 32);
                    ldsm_x4(b[kt], b_base + kt * 32);
                }
#pragma unroll
                for (int kt = 0; kt < KT; ++kt) {
                    mma16816(acc[kt & 1][0], a[kt], b[kt][0], b[kt][1]);
                    mma16816(acc[kt & 1][1], a[kt], b[kt][2], b[kt][3]);
                }
                float* m0 = mine + (mt * 16 + g) * PS + 2 * t;
                *reinterpret_cast<float2*>(m0) = make_float2(acc[0][0][0] + acc[1][0][0], acc[0][0][1] + acc[1][0][1]);
                *reinterpret_cast<float2*>(m0 + 8 * PS) = make_float2(acc[0][0][2] + acc[1][0][2], acc[0][0][3] + acc[1][0][3]);
                if (t == 0) {
                    *reinterpret_cast<float2*>(m0 + 8) = make_float2(acc[0][1][0] + acc[1][1][0], acc[0][1][1] + acc[1][1][1]);
                    *reinterpret_cast<float2*>(m0 + 8 * PS + 8) = make_float2(acc[0][1][2] + acc[1][1][2], acc[0][1][3] + acc[1][1][3]);
                }
            }
            PROF_T(8);
            fence_proxy_async();      // generic stores -> visible to the bulk-copy engine
            named_sync(1, NCT);
            if (lane == 0 && warp < C && warp != (int)rank) {   // one issuing thread per peer, in different warps
                const int d = warp, nr = rows_of(d);
                if (nr > 0)
                    bulk_s2c(smem_u32(rs + (rank * RPC) * PS), smem_u32(mine + d * RPC * PS), nr * PS * 4,
                             smem_u32(bar_rs), d);
            }
            if (s > 0) flush_stats(s - 1);   // the previous step's loss sums, while the partials travel
            PROF_T(1);

            // ---- 2. while the partials travel: convert the next batch ----
            int ylab_next = 0;
            if (s + 1 < steps) {
                const int st1 = (s + 1) % STAGES;
                mbar_wait(smem_u32(&bar_full[st1]), ((s + 1) / STAGES) & 1);
                ylab_next = convert(st1, xh + ((s + 1) & 1) * BP * XS);
            }
            PROF_T(2);

            // ---- 3. softmax of the own rows: sum the C partials, loss, accuracy, g -> own rows of gbuf ----
            mbar_wait_cluster(smem_u32(bar_rs), s & 1);
            if (tid == 0 && s + 1 < steps) mbar_arrive_expect_tx(smem_u32(bar_rs), tx_rs);
            PROF_T(3);
            if (warp < SMW) {
                float z[4] = {0.f, 0.f, 0.f, 0.f};
                if (sm_valid) {
#pragma unroll
                    for (int src = 0; src < C; ++src) {   // our own partial straight from `mine` (no copy to self)
                        const float* rp = (src == (int)rank) ? mine + (r_lo + srow) * PS : rs + (src * RPC + srow) * PS;
                        const float2 v = *reinterpret_cast<const float2*>(rp + 2 * t);
                        z[0] += v.x;
                        z[1] += v.y;
                        if (t == 0) {
                            const float2 w = *reinterpret_cast<const float2*>(rp + 8);
                            z[2] += w.x;
                            z[3] += w.y;
                        }
                    }
                }
                const int cls[4] = {2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t};
                float mx = FT_NEG_INF;
                int best = 16;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bool valid = (e < 2) || (t == 0);
                    z[e] = valid ? z[e] * inv255 + bias_s[cls[e]] : FT_NEG_INF;
                    if (valid && (z[e] > mx || (z[e] == mx && cls[e] < best))) { mx = z[e]; best = cls[e]; }
                }
#pragma unroll
                for (int o = 1; o <= 2; o <<= 1) {
                    const float om = __shfl_xor_sync(0xffffffffu, mx, o);
                    const int ob = __shfl_xor_sync(0xffffffffu, best, o);
                    if (om > mx || (om == mx && ob < best)) { mx = om; best = ob; }
                }
                float ex[4], se = 0.f;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    ex[e] = (e < 2 || t == 0) ? __expf(z[e] - mx) : 0.f;
                    se += ex[e];
                }
                se += __shfl_xor_sync(0xffffffffu, se, 1);
                se += __shfl_xor_sync(0xffffffffu, se, 2);
                if (sm_valid) {
                    const int y = ylab;
                    const bool live = grow < rows;
                    const float inv = 1.0f / se;
                    float gv[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) gv[e] = live ? ex[e] * inv - (cls[e] == y ? 1.f : 0.f) : 0.f;
                    u32* gp = reinterpret_cast<u32*>(gbuf + grow * DS);
                    gp[t] = pack2(gv[0], gv[1]);
                    gp[4 + t] = pack2(gv[2], gv[3]);
                    const bool owner = (y >> 1) == t || (t == 0 && (y == 8 || y == 9));
                    if (live && owner) {
                        const float zy = (y < 8) ? ((y & 1) ? z[1] : z[0]) : ((y & 1) ? z[3] : z[2]);
                        pend_loss = __logf(se) - (zy - mx);   // stored after the fence (below)
                        pend_ok = (best == y) ? 1.f : 0.f;
                        pend = true;
                    }
                }
                PROF_T(9);
                fence_proxy_async();  // only the writers of g need it
            }
            named_sync(1, NCT);       // own g rows written; the next batch converted by everyone
            PROF_T(10);
            if (tid == 0 && s + 1 < steps) mbar_arrive(smem_u32(&bar_empty[(s + 1) % STAGES]));
            if (lane == 0 && warp < C && warp != (int)rank && my_rows > 0)
                bulk_s2c(smem_u32(gbuf + r_lo * DS), smem_u32(gbuf + r_lo * DS), my_rows * DS * 2, smem_u32(bar_ag), warp);
            // X fragments of this warp's dW tiles, loaded while g travels
            u32 bfr[NTW][MT][2];
#pragma unroll
            for (int i = 0; i < NTW; ++i) {
                const int j = min(warp + NCW * i, NT - 1);
#pragma unroll
                for (int kk = 0; kk < MT; ++kk)
                    ldsm_x2_t(bfr[i][kk][0], bfr[i][kk][1], smem_u32(xb + (kk * 16 + (lane & 15)) * XS + j * 8));
            }
            ylab = ylab_next;
            PROF_T(4);

            // ---- 4. all g rows in: dW^T = g^T @ X_int for this CTA's slice, SGD update in registers ----
            mbar_wait_cluster(smem_u32(bar_ag), s & 1);
            if (tid == 0 && s + 1 < steps) mbar_arrive_expect_tx(smem_u32(bar_ag), tx_ag);
            PROF_T(5);
            u32 afr[MT][4];
#pragma unroll
            for (int kk = 0; kk < MT; ++kk) {
                const int q = lane >> 3, r = lane & 7;
                ldsm_x4_t(afr[kk], smem_u32(gbuf + (kk * 16 + (q >> 1) * 8 + r) * DS + (q & 1) * 8));
            }
            const float wscale = lr * inv255 / (float)rows;
            const float bscale = lr / (float)rows;
#pragma unroll
            for (int i = 0; i < NTW; ++i) {
                const int j = warp + NCW * i;
                if (j > NT) break;
                float acc[2][4] = {};
                if (j < NT) {
#pragma unroll
                    for (int kk = 0; kk < MT; ++kk) mma16816(acc[kk & 1], afr[kk], bfr[i][kk][0], bfr[i][kk][1]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) wm[i][e] -= wscale * (acc[0][e] + acc[1][e]);
                    *reinterpret_cast<u32*>(wt16 + g * XS + j * 8 + 2 * t) = pack2(wm[i][0], wm[i][1]);
                    *reinterpret_cast<u32*>(wt16 + (g + 8) * XS + j * 8 + 2 * t) = pack2(wm[i][2], wm[i][3]);
                } else {
                    const u32 ones = pack2(1.f, 1.f);
#pragma unroll
                    for (int kk = 0; kk < MT; ++kk) mma16816(acc[kk & 1], afr[kk], ones, ones);
                    if (t == 0) {
                        bm0 -= bscale * (acc[0][0] + acc[1][0]);
                        bm1 -= bscale * (acc[0][2] + acc[1][2]);
                        bias_s[g] = bm0;
                        bias_s[g + 8] = bm1;
                    }
                }
            }
            named_sync(1, NCT);   // W16 and bias updated before the next forward reads them
            PROF_T(6);
        }

        if (steps > 0) flush_stats(steps - 1);
        // ---- epoch end: masters back to global memory ----
#pragma unroll
        for (int i = 0; i < NTW; ++i) {
            const int j = warp + NCW * i;
            if (j < 2 * ktn) {
                const int f = kt0 * 16 + j * 8 + 2 * t;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = g + (e >> 1) * 8;
                    if (c < NCLS) Wt[c * NFEAT + f + (e & 1)] = wm[i][e];
                }
            }
            if (j == NT && rank == 0 && t == 0) {
                bias[g] = bm0;
                if (g + 8 < NCLS) bias[g + 8] = bm1;
            }
        }
    }
#if FT_PROF
    if (prof_on) {
        for (int i = 0; i < 16; ++i) prof[rank * 32 + (tid == NCT ? 16 : 0) + i] = pacc[i];
    }
#endif
    cluster_sync_all();   // every CTA's row_loss/row_ok writes visible to rank 0 (release/acquire, cluster scope)
    if (rank == 0 && warp < NCW) {   // per step, C * SMW (loss, correct) records of the warps of every CTA
        ft_warp_step_stats(out, red, steps, B, n, C * SMW, warp, NCW, lane, [&](int s, int r, float& l, float& c) {
            l += __ldcg(row_loss + ((size_t)s * C * SMW + r) * 2);
            c += __ldcg(row_loss + ((size_t)s * C * SMW + r) * 2 + 1);
        });
        named_sync(1, NCT);
        if (tid == 0) ft_publish_epoch(out, red, NCW, steps, flag);
    }
}
