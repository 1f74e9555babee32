// fused_logreg_v5.cu: rung 8 for logreg, one persistent kernel per epoch on a thread-block cluster.
//
// Version history (llm.c dev/cuda style; NOTES-fused.md has the prediction and outcome of each):
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
//       Measured (H200): 1.41 ms/epoch (~4800 cycles a step; two exchange round trips of ~1000 cycles each).
//   v5  ONE exchange a step instead of two: every CTA bulk-copies its fp32 partial logits of ALL rows (its K-slice's
//       contribution, BP rows x 10 classes, 40 bytes a row) into a slot of every other CTA (the v1 all-to-all with
//       v2's transport); every CTA then sums the C partials of every row itself (in rank order, so all CTAs get
//       bit-identical logits and g), does the softmax / g of all rows redundantly and its own dW slice from its X
//       slice and the full g: no all-gather of g, no second round trip. Receive slots and `mine` double-buffered
//       by step parity (see "Buffer reuse" below); only rank 0 keeps the loss/accuracy sums.
//       Cost: bytes into each CTA a step (C-1) * BP * 40 = 30 KB for C = 7, B = 128 (v4: 2 x ~6 KB), and out of
//       each CTA the same; 215 KB over DSMEM a step for the cluster. The copy engine's rate for this is not
//       measured yet; the bet is that one ~30 KB round trip costs less than two ~6 KB ones (~1000 cycles each).
//
// The math per step (B' rows, x = pixel/255, X_int = pixels as exact integers):
//   logits = (X_int @ W16) / 255 + b ; g = softmax(logits) - onehot(y) ; W^T -= lr/(255 B') g^T @ X_int ;
//   b -= lr/B' colsum(g). Per step and cluster: 6.4 MFLOP of mma (classes padded to 16); 100 KB of pixels;
//   over DSMEM (C-1) * BP * 40 bytes into each CTA.
//
// Buffer reuse (why parity double-buffering is enough; no empty barriers): step s uses mine[s&1], rx[s&1] and
// bar_rx[s&1] (phase s>>1). CTA S writes mine[p] again at step s+2 only after it waited for every peer's step-s+1
// partials; a peer D sends those only after it waited for its own step-s data, which includes S's copy out of
// mine[p]: so that copy has finished reading mine[p]. Likewise D reads rx[p] (step s) before its step-s+1 sends,
// and S's step-s+2 copy into D's rx[p] is issued only after S received D's step-s+1 partials. tid 0 re-arms
// bar_rx[p] (arrive.expect_tx) right after the step-s wait, before this CTA's step-s+1 sends, so no step-s+2 byte can
// reach bar_rx[p] before it is re-armed (and a byte arriving early would only make the new phase's tx-count
// negative: the phase cannot complete before tid 0's arrival).
//
// Compile-time configuration (-D): FT_C cluster size, FT_KT k-tiles per CTA (ceil(49/C)), FT_MT m-tiles per
// batch (<= 12), FT_STAGES ring depth, FT_BF16, FT_PW producer warps, FT_PROF. (Two activation buffers always.)
// Compile alone: nvcc --ptx -arch=sm_90 fused_logreg_v5.cu
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
#define DS 24                          // gbuf row: 16 classes + 8 (conflict-free ldmatrix rows)
#define PS 10                          // partial-logit row: the 10 real classes (40 bytes; BP * 40 is a multiple of 16)
#define NT (2 * KT)
#define NTW ((NT + 1 + NCW - 1) / NCW)
#define MTW ((MT + NCW - 1) / NCW)
#define NFEAT 784
#define NCLS 10
#define STAGES FT_STAGES
#define RPT ((BP + NCT / 2 - 1) / (NCT / 2))   // softmax rows per pair of threads (2 lanes a row, all rows)
#define PBYTES (BP * PS * 4)                   // one CTA's partials: one bulk copy

#define A128(x) ((((x) + 127) / 128) * 128)
#define OFF_BAR 0                                     // full[S] empty[S] rx[2]
#define OFF_BIAS 256                                  // float[16]
#define OFF_SX 512                                    // u8 [S][BP][KF]
#define OFF_SY A128(OFF_SX + STAGES * BP * KF)        // int [S][BP]
#define OFF_XH A128(OFF_SY + STAGES * BP * 4)         // elem [2][BP][XS]
#define OFF_WT A128(OFF_XH + 2 * BP * XS * 2)         // elem [16][XS]
#define OFF_G A128(OFF_WT + 16 * XS * 2)              // elem [BP][DS]  g of all rows (computed here)
#define OFF_MINE A128(OFF_G + BP * DS * 2)            // float [2][BP][PS] this CTA's partial logits, by step parity
#define OFF_RX A128(OFF_MINE + 2 * PBYTES)            // float [2][C-1][BP][PS] the peers' partials, by step parity
#define OFF_RED A128(OFF_RX + 2 * (C - 1) * PBYTES)   // double [2][NCW]
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

extern "C" __global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(NTHREADS, 1)
logreg_epoch(const u8* __restrict__ X, const int* __restrict__ Y, const int* __restrict__ order,
             int n, int B, int steps, float lr,
             float* __restrict__ Wt, float* __restrict__ bias,
             float* __restrict__ row_loss,    // scratch [steps][NCW][2]: per-step loss/correct sums of rank 0's warps
             u8* __restrict__ row_ok,         // unused (v1/v2 per-example flags)
             double* __restrict__ out,        // [2 + steps + 1]: ..., and last the completion flag (= flag)
             double flag,
             long long* __restrict__ prof)
{
    extern __shared__ __align__(128) unsigned char smem[];
    u64* bar_full = reinterpret_cast<u64*>(smem + OFF_BAR);
    u64* bar_empty = bar_full + STAGES;
    u64* bar_rx = bar_empty + STAGES;             // [2]: the peers' partials of even / odd steps
    float* bias_s = reinterpret_cast<float*>(smem + OFF_BIAS);
    u8* sx = smem + OFF_SX;
    int* sy = reinterpret_cast<int*>(smem + OFF_SY);
    elem_t* xh = reinterpret_cast<elem_t*>(smem + OFF_XH);
    elem_t* wt16 = reinterpret_cast<elem_t*>(smem + OFF_WT);
    elem_t* gbuf = reinterpret_cast<elem_t*>(smem + OFF_G);
    float* mine = reinterpret_cast<float*>(smem + OFF_MINE);
    float* rx = reinterpret_cast<float*>(smem + OFF_RX);
    double* red = reinterpret_cast<double*>(smem + OFF_RED);

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const u32 rank = cluster_rank();
    const int kt0 = rank * KT;
    const int ktn = min(KT, NFEAT / 16 - kt0);
    const u32 tx_rx = (C - 1) * PBYTES;          // every other CTA sends us its partials of all rows

    if (tid < STAGES) {
        mbar_init(smem_u32(&bar_full[tid]), NPW * 32);
        mbar_init(smem_u32(&bar_empty[tid]), 1);
    }
    if (tid == 0) {
        for (int p = 0; p < 2; ++p) {
            mbar_init(smem_u32(&bar_rx[p]), 1);
            mbar_arrive_expect_tx(smem_u32(&bar_rx[p]), tx_rx);   // armed for steps 0 and 1
        }
    }
    fence_mbar_init();
    for (int i = tid; i < 2 * BP * XS / 2; i += NTHREADS) reinterpret_cast<u32*>(xh)[i] = 0u;
    for (int i = tid; i < BP * DS / 2; i += NTHREADS) reinterpret_cast<u32*>(gbuf)[i] = 0u;   // classes 10..15 stay 0
    for (int i = tid; i < 2 * BP * PS; i += NTHREADS) mine[i] = 0.f;
    for (int i = tid; i < 16 * XS / 2; i += NTHREADS) {
        const int c = i / (XS / 2), f = 2 * (i % (XS / 2));
        const float w0 = (f < ktn * 16) ? Wt[c * NFEAT + kt0 * 16 + f] : 0.f;
        const float w1 = (f + 1 < ktn * 16) ? Wt[c * NFEAT + kt0 * 16 + f + 1] : 0.f;
        reinterpret_cast<u32*>(wt16)[i] = pack2(w0, w1);
    }
    if (tid < 16) bias_s[tid] = bias[tid];
    cluster_sync_all();   // barriers initialized in every CTA before any copy targets them
#if FT_PROF
    const bool prof_on = (tid == 0) || (tid == NCT);
    long long pacc[16] = {};
    long long plast = clock64();
#endif

    if (warp >= NCW) {
        // ================= producer warp(s) (as v4) =================
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
        // softmax mapping: 2 lanes a row (h = 0: classes 0..3 and 8; h = 1: classes 4..7 and 9), all BP rows;
        // row r = tid/2 + 128 i. A warp covers 16 consecutive rows, so `r < BP` is uniform per warp.
        const int h = tid & 1;
        const bool stats_cta = (rank == 0);       // every CTA computes the same logits; rank 0 keeps the stats

        // convert stage `st` into activation buffer `xb` (exact integers); the labels of this thread's softmax rows
        auto convert = [&](int st, elem_t* xb, int (&lab)[RPT]) {
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
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int r = (tid >> 1) + (NCT / 2) * i;
                lab[i] = (r < BP) ? sy[st * BP + r] : 0;
            }
        };

        int ylab[RPT] = {};
        float pend_loss = 0.f, pend_ok = 0.f;
        // per-step loss/accuracy (rank 0 only): warp sums, one store per warp and step
        auto flush_stats = [&](int s_done) {
            if (stats_cta) {
                const float wl = warp_sum(pend_loss);
                const float wc = warp_sum(pend_ok);
                if (lane == 0) {
                    row_loss[((size_t)s_done * NCW + warp) * 2] = wl;
                    row_loss[((size_t)s_done * NCW + warp) * 2 + 1] = wc;
                }
                pend_loss = 0.f;
                pend_ok = 0.f;
            }
        };
        // prologue: step 0's batch
        if (steps > 0) {
            mbar_wait(smem_u32(&bar_full[0]), 0);
            convert(0, xh, ylab);
            named_sync(1, NCT);
            if (tid == 0) mbar_arrive(smem_u32(&bar_empty[0]));
        }
        const float inv255 = 1.0f / 255.0f;

        for (int s = 0; s < steps; ++s) {
            const int rows = min(B, n - s * B);
            const int p = s & 1;
            const elem_t* xb = xh + p * BP * XS;
            float* mp = mine + p * BP * PS;
            float* rxp = rx + p * (C - 1) * BP * PS;
            PROF_T(0);

            // ---- 1. partial logits of all rows (this CTA's K-slice), into mine[p] ----
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
                float* m0 = mp + (mt * 16 + g) * PS + 2 * t;
                *reinterpret_cast<float2*>(m0) = make_float2(acc[0][0][0] + acc[1][0][0], acc[0][0][1] + acc[1][0][1]);
                *reinterpret_cast<float2*>(m0 + 8 * PS) = make_float2(acc[0][0][2] + acc[1][0][2], acc[0][0][3] + acc[1][0][3]);
                if (t == 0) {   // classes 8, 9 (10..15 are padding)
                    *reinterpret_cast<float2*>(m0 + 8) = make_float2(acc[0][1][0] + acc[1][1][0], acc[0][1][1] + acc[1][1][1]);
                    *reinterpret_cast<float2*>(m0 + 8 * PS + 8) = make_float2(acc[0][1][2] + acc[1][1][2], acc[0][1][3] + acc[1][1][3]);
                }
            }
            PROF_T(8);
            fence_proxy_async();      // generic stores -> visible to the bulk-copy engine
            named_sync(1, NCT);
            // ---- 2. the one exchange: mine[p] -> slot of this CTA in every peer's rx[p] (lane 0 of warp d -> CTA d) ----
            if (lane == 0 && warp < C && warp != (int)rank) {
                const int d = warp;
                const int slot = (int)rank - ((int)rank > d ? 1 : 0);   // the peers' slots skip the receiver itself
                bulk_s2c(smem_u32(rx + (p * (C - 1) + slot) * BP * PS), smem_u32(mp), PBYTES,
                         smem_u32(&bar_rx[p]), d);
            }
            if (s > 0) flush_stats(s - 1);   // the previous step's loss sums, while the partials travel
            PROF_T(1);

            // ---- 3. while the partials travel: X fragments of this warp's dW tiles, then convert the next batch ----
            u32 bfr[NTW][MT][2];
#pragma unroll
            for (int i = 0; i < NTW; ++i) {
                const int j = min(warp + NCW * i, NT - 1);
#pragma unroll
                for (int kk = 0; kk < MT; ++kk)
                    ldsm_x2_t(bfr[i][kk][0], bfr[i][kk][1], smem_u32(xb + (kk * 16 + (lane & 15)) * XS + j * 8));
            }
            PROF_T(4);
            int ylab_next[RPT] = {};
            if (s + 1 < steps) {
                const int st1 = (s + 1) % STAGES;
                mbar_wait(smem_u32(&bar_full[st1]), ((s + 1) / STAGES) & 1);
                convert(st1, xh + (p ^ 1) * BP * XS, ylab_next);
            }
            PROF_T(2);

            // ---- 4. all partials in: logits, softmax, loss, accuracy, g of ALL rows (redundantly in every CTA) ----
            mbar_wait_cluster(smem_u32(&bar_rx[p]), (s >> 1) & 1);
            if (tid == 0 && s + 2 < steps) mbar_arrive_expect_tx(smem_u32(&bar_rx[p]), tx_rx);   // for step s + 2
            PROF_T(3);
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int r = (tid >> 1) + (NCT / 2) * i;
                if (r >= BP) break;   // uniform per warp
                float z[5] = {0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int src = 0; src < C; ++src) {   // rank order in every CTA: bit-identical sums everywhere
                    const float* rp = (src == (int)rank) ? mp + r * PS
                                                         : rxp + ((src - (src > (int)rank ? 1 : 0)) * BP + r) * PS;
                    const float2 u = *reinterpret_cast<const float2*>(rp + 4 * h);
                    const float2 v = *reinterpret_cast<const float2*>(rp + 4 * h + 2);
                    z[0] += u.x;
                    z[1] += u.y;
                    z[2] += v.x;
                    z[3] += v.y;
                    z[4] += rp[8 + h];
                }
                float mx = FT_NEG_INF;
                int best = 16;
#pragma unroll
                for (int e = 0; e < 5; ++e) {   // classes ascending within the thread: ties keep the lower class
                    const int c = (e < 4) ? 4 * h + e : 8 + h;
                    z[e] = z[e] * inv255 + bias_s[c];
                    if (z[e] > mx) { mx = z[e]; best = c; }
                }
                {
                    const float om = __shfl_xor_sync(0xffffffffu, mx, 1);
                    const int ob = __shfl_xor_sync(0xffffffffu, best, 1);
                    if (om > mx || (om == mx && ob < best)) { mx = om; best = ob; }
                }
                float ex[5], se = 0.f;
#pragma unroll
                for (int e = 0; e < 5; ++e) {
                    ex[e] = __expf(z[e] - mx);
                    se += ex[e];
                }
                se += __shfl_xor_sync(0xffffffffu, se, 1);
                const int y = ylab[i];
                const bool live = r < rows;   // rows beyond the batch (last batch, padding): g = 0, no stats
                const float inv = 1.0f / se;
                float gv[5];
#pragma unroll
                for (int e = 0; e < 5; ++e) {
                    const int c = (e < 4) ? 4 * h + e : 8 + h;
                    gv[e] = live ? ex[e] * inv - (c == y ? 1.f : 0.f) : 0.f;
                }
                const float g_pair = __shfl_xor_sync(0xffffffffu, gv[4], 1);   // class 9 from lane h = 1
                u32* gp = reinterpret_cast<u32*>(gbuf + r * DS);
                gp[2 * h] = pack2(gv[0], gv[1]);
                gp[2 * h + 1] = pack2(gv[2], gv[3]);
                if (h == 0) gp[4] = pack2(gv[4], g_pair);
                if (stats_cta && live) {
                    const bool owner = (y < 8) ? ((y >> 2) == h) : ((y - 8) == h);
                    if (owner) {
                        const int e = (y < 8) ? (y & 3) : 4;
                        const float zy = (e == 0) ? z[0] : (e == 1) ? z[1] : (e == 2) ? z[2] : (e == 3) ? z[3] : z[4];
                        pend_loss += __logf(se) - (zy - mx);
                        pend_ok += (best == y) ? 1.f : 0.f;
                    }
                }
            }
            PROF_T(9);
            named_sync(1, NCT);       // all g rows written; the next batch converted by everyone
            PROF_T(10);
            if (tid == 0 && s + 1 < steps) mbar_arrive(smem_u32(&bar_empty[(s + 1) % STAGES]));
#pragma unroll
            for (int i = 0; i < RPT; ++i) ylab[i] = ylab_next[i];

            // ---- 5. dW^T = g^T @ X_int for this CTA's slice, SGD update in registers (as v4) ----
            u32 afr[MT][4];
#pragma unroll
            for (int kk = 0; kk < MT; ++kk) {
                const int q = lane >> 3, rr = lane & 7;
                ldsm_x4_t(afr[kk], smem_u32(gbuf + (kk * 16 + (q >> 1) * 8 + rr) * DS + (q & 1) * 8));
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
            named_sync(1, NCT);   // W16, bias and g consumed/updated before the next step writes or reads them
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
    // No CTA leaves while a peer may still read its `mine` or write its rx (every CTA has received all of its
    // data once it is here); also orders rank 0's row_loss stores before its reads below.
    cluster_sync_all();
    if (rank == 0 && warp < NCW) {
        double wl = 0.0, wc = 0.0;
        for (int s = warp; s < steps; s += NCW) {
            const int rows = min(B, n - s * B);
            float l = 0.f, c = 0.f;
            if (lane < NCW) {
                l = __ldcg(row_loss + ((size_t)s * NCW + lane) * 2);
                c = __ldcg(row_loss + ((size_t)s * NCW + lane) * 2 + 1);
            }
            l = warp_sum(l);
            c = warp_sum(c);
            if (lane == 0) out[2 + s] = (double)l / rows;
            wl += l;
            wc += c;
        }
        if (lane == 0) { red[warp] = wl; red[NCW + warp] = wc; }
        named_sync(1, NCT);
        if (tid == 0) {
            double L = 0.0, A = 0.0;
            for (int w = 0; w < NCW; ++w) { L += red[w]; A += red[NCW + w]; }
            out[0] = L;
            out[1] = A;
            __threadfence_system();
            out[2 + steps] = flag;   // last: the host may stop waiting once it reads this value
        }
    }
}
