// fused_common.cuh: PTX helpers shared by the fused kernels of rungs 7 and 8 (fused_*.cu).
//
// Everything here is a thin wrapper over one PTX instruction (sm_90): tensor-core mma.sync,
// ldmatrix/movmatrix, cp.async, mbarrier, thread-block-cluster addressing (mapa, st.async) and
// barriers. Compiled by NVRTC (CuPy RawModule) or nvcc; no CUDA headers beyond cuda_fp16/bf16.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FT_NEG_INF __int_as_float(0xff800000)   // -inf without math.h (NVRTC has no libc headers)

// Operand type of every GEMM: FT_BF16=1 -> bf16, else fp16. Accumulation is always fp32.
#if FT_BF16
typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat162 elem2_t;
#define FT_MMA_TYPE "bf16"
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}
#else
typedef __half elem_t;
typedef __half2 elem2_t;
#define FT_MMA_TYPE "f16"
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}
#endif

__device__ __forceinline__ float2 unpack2(u32 v) {
#if FT_BF16
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
    return __bfloat1622float2(h);
#else
    __half2 h = *reinterpret_cast<__half2*>(&v);
    return __half22float2(h);
#endif
}

// Four pixels (bytes of v) -> two packed pairs of exact integers 0..255 in the operand type.
// fp16: 0x6400|b is the half 1024+b, so one byte_perm and one subtraction per pair.
__device__ __forceinline__ void bytes4_to_elem(u32 v, u32& lo, u32& hi) {
#if FT_BF16
    // fp32 0x4B000000|b = 2^23 + b; subtract 2^23 to get b exactly, then round (exact) to bf16.
    float f0 = __uint_as_float(__byte_perm(v, 0x4B00u, 0x5440)) - 8388608.0f;
    float f1 = __uint_as_float(__byte_perm(v, 0x4B00u, 0x5441)) - 8388608.0f;
    float f2 = __uint_as_float(__byte_perm(v, 0x4B00u, 0x5442)) - 8388608.0f;
    float f3 = __uint_as_float(__byte_perm(v, 0x4B00u, 0x5443)) - 8388608.0f;
    lo = pack2(f0, f1);
    hi = pack2(f2, f3);
#else
    u32 a = __byte_perm(v, 0x6464u, 0x4140);  // halves (1024+b0, 1024+b1)
    u32 b = __byte_perm(v, 0x6464u, 0x4342);  // halves (1024+b2, 1024+b3)
    const __half2 k1024 = __floats2half2_rn(1024.0f, 1024.0f);
    __half2 ha = __hsub2(*reinterpret_cast<__half2*>(&a), k1024);
    __half2 hb = __hsub2(*reinterpret_cast<__half2*>(&b), k1024);
    lo = *reinterpret_cast<u32*>(&ha);
    hi = *reinterpret_cast<u32*>(&hb);
#endif
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// D(16x8, fp32) += A(16x16, row) * B(16x8, col). 2*16*8*16 = 4096 FLOP.
__device__ __forceinline__ void mma16816(float d[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." FT_MMA_TYPE "." FT_MMA_TYPE ".f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_t(u32& r0, u32& r1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(u32& r0, u32& r1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r0), "=r"(r1) : "r"(addr));
}
// Transpose an 8x8 b16 matrix held one pair per lane (row lane/4, cols 2*(lane%4)+{0,1}).
__device__ __forceinline__ u32 movmatrix_t(u32 v) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
}

// ---- cp.async (Ampere-style asynchronous global->shared copies) ----
__device__ __forceinline__ void cp_async16(u32 saddr, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(saddr), "l"(g) : "memory");
}
// src_size 0 copies nothing and fills the 16 bytes with zeros (a padding row of the batch)
__device__ __forceinline__ void cp_async16_zfill(u32 saddr, const void* g, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(saddr), "l"(g), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 saddr, const void* g) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(saddr), "l"(g) : "memory");
}
// The mbarrier gets one arrival once all of this thread's earlier cp.async have landed.
__device__ __forceinline__ void cp_async_mbar_arrive(u32 mbar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(mbar) : "memory");
}
// Programmatic dependent launch (a kernel launched with the programmatic-stream-serialization attribute may
// start while the kernel before it in the stream still runs). griddepcontrol.wait blocks until that kernel
// has completed and its memory operations are visible; launch_dependents lets the next kernel start once
// every block of this one has issued it (or exited). Both are no-ops in a kernel launched without the
// attribute.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// ---- mbarrier ----
__device__ __forceinline__ void mbar_init(u32 mbar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(mbar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 mbar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }\n" :: "r"(mbar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 mbar, u32 bytes) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }\n"
                 :: "r"(mbar), "r"(bytes) : "memory");
}
// Wait until the phase with this parity has completed (acquire at CTA scope).
__device__ __forceinline__ void mbar_wait(u32 mbar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                     : "=r"(done) : "r"(mbar), "r"(parity) : "memory");
    } while (!done);
}
// Same, acquiring at cluster scope: for data that other CTAs of the cluster wrote into our shared memory.
__device__ __forceinline__ void mbar_wait_cluster(u32 mbar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                     : "=r"(done) : "r"(mbar), "r"(parity) : "memory");
    } while (!done);
}

// ---- thread-block clusters ----
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// The shared::cluster address of the variable at local shared address `addr` in CTA `rank`.
__device__ __forceinline__ u32 mapa(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ u32 cluster_size() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
    return r;
}
// Load a float from the shared memory of a CTA of the cluster (an address from mapa).
__device__ __forceinline__ float ld_cluster_f32(u32 raddr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(raddr) : "memory");
    return v;
}
// Store 8 bytes into another CTA's shared memory; its mbarrier's tx-count drops by 8 when they land.
__device__ __forceinline__ void st_async_v2(u32 raddr, float a, float b, u32 rbar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n"
                 :: "r"(raddr), "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(rbar) : "memory");
}
__device__ __forceinline__ void st_async_u32(u32 raddr, u32 v, u32 rbar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n"
                 :: "r"(raddr), "r"(v), "r"(rbar) : "memory");
}
__device__ __forceinline__ void st_async_v2u(u32 raddr, u32 a, u32 b, u32 rbar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n"
                 :: "r"(raddr), "r"(a), "r"(b), "r"(rbar) : "memory");
}
// All threads of all CTAs of the cluster (release/acquire: orders shared and global memory).
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Named barrier among `count` threads (a multiple of 32) of this CTA.
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- the end of a persistent epoch kernel: the epoch's results in host-mapped memory -------------------
// `out` is pinned host memory of [2 + steps + 1] doubles: out[0] the epoch's loss sum, out[1] its correct
// count, out[2 + s] the mean loss of step s, and last out[2 + steps] = flag, the value the host spins on.
// Each of `np` participants (warps or threads) sums its share of the steps into red[i] (loss) and
// red[np + i] (correct); after a barrier over all of them, one thread publishes the totals.

// One warp's share: steps s = warp, warp + nwarps, ...; `entry(s, r, loss, correct)` adds entry r of step s
// (`records` entries a step; 0: one entry a row of the step's batch); lane 0 writes the step's mean loss.
template <class Entry>
__device__ __forceinline__ void ft_warp_step_stats(double* out, double* red, int steps, int batch, int n,
                                                   int records, int warp, int nwarps, int lane, Entry entry) {
    double wl = 0.0, wc = 0.0;
    for (int s = warp; s < steps; s += nwarps) {
        const int rows = min(batch, n - s * batch);
        float l = 0.f, c = 0.f;
        for (int r = lane; r < (records > 0 ? records : rows); r += 32) entry(s, r, l, c);
        l = warp_sum(l);
        c = warp_sum(c);
        if (lane == 0) out[2 + s] = (double)l / rows;
        wl += l;
        wc += c;
    }
    if (lane == 0) {
        red[warp] = wl;
        red[nwarps + warp] = wc;
    }
}

// One thread's share: steps s = tid, tid + nthreads, ...; `step(s, loss, correct)` gives step s's sums.
template <class Step>
__device__ __forceinline__ void ft_thread_step_stats(double* out, double* red, int steps, int batch, int n,
                                                     int tid, int nthreads, Step step) {
    double wl = 0.0, wc = 0.0;
    for (int s = tid; s < steps; s += nthreads) {
        float l = 0.f, c = 0.f;
        step(s, l, c);
        out[2 + s] = (double)l / min(batch, n - s * batch);
        wl += l;
        wc += c;
    }
    red[tid] = wl;
    red[nthreads + tid] = wc;
}

// The totals of the np participants, then the completion flag (after a system-scope fence, so the host
// never sees the flag before the figures).
__device__ __forceinline__ void ft_publish_epoch(double* out, const double* red, int np, int steps, double flag) {
    double loss = 0.0, correct = 0.0;
    for (int i = 0; i < np; ++i) {
        loss += red[i];
        correct += red[np + i];
    }
    out[0] = loss;
    out[1] = correct;
    __threadfence_system();
    out[2 + steps] = flag;
}
