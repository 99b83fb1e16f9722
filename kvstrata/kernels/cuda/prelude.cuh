// The device helpers every kernel here starts with: bf16 bits, loads through L2, the grid
// barrier and the per-head split counters, mbarriers, bulk and tensor copies, `ldmatrix`, the
// bf16 `mma`. Its includer defines STAMPS (0/1) first; STAMP(k) then writes %globaltimer into
// stamps[block * 16 + k].
typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;
struct __align__(16) v4 { u32 x, y, z, w; };
struct __align__(64) TMap { u64 v[16]; };   // a CUtensorMap, passed by value
#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ u32 sa(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float bf(bf16_t h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ bf16_t to_bf(float f) {   // round to nearest even (finite values)
    u32 u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}
__device__ __forceinline__ u32 pack_bf(float lo, float hi) {
    return (u32)to_bf(lo) | ((u32)to_bf(hi) << 16);
}
__device__ __forceinline__ void unpack8(const v4& v, float* f) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}
__device__ __forceinline__ v4 ld_cg(const void* p) {   // through L2: other blocks wrote it
    v4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float ld_cg_f(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// A source defining PDL as 1 is launched as a programmatic dependent launch (Kernel(...,
// pdl=True)): GDC_WAIT() before it reads what the previous kernel on the stream wrote.
#if defined(PDL) && PDL
#define GDC_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define GDC_WAIT()
#endif
#if STAMPS
#define STAMP(k) if (threadIdx.x == 0) { u64 t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); stamps[blockIdx.x * 16 + (k)] = t_; }
#else
#define STAMP(k)
#endif

// All blocks meet. The counter only grows: a barrier's target is the next multiple of the grid.
// The block's writes are ordered before its arrival by the block barrier and the arrival's
// release, and the other blocks' writes before what follows by the acquire loads and the block
// barrier (no fences of their own: __threadfence() before the arrival and after the wait cost
// 0.02-0.03 ms per batch-1 step, docs/benchmarks.md twenty-second runner session).
// ``leader``: the thread that arrives and waits for its block (the release is cumulative: the
// block barrier before it orders every thread's writes, so any thread of the block may lead;
// one with no loads in flight arrives sooner).
// One arrival on a counter that grows by `n` per launch (2**32 a multiple of n); with `wait`,
// until all n of this launch have arrived (the target: the next multiple of n).
__device__ __forceinline__ void arrive(u32* ctr, u32 n, bool wait) {
    u32 old;
    asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;"
                 : "=r"(old) : "l"(ctr) : "memory");
    const u32 target = old - old % n + n;
    if (wait)
        while ((int)(ld_acquire(ctr) - target) < 0) { }
}
__device__ __forceinline__ void grid_barrier_by(u32* ctr, int leader) {
    __syncthreads();
    if (threadIdx.x == leader) arrive(ctr, gridDim.x, true);
    __syncthreads();
}
__device__ __forceinline__ void grid_barrier(u32* ctr) { grid_barrier_by(ctr, 0); }
// KV head h's arrival counter for launches of `splits` (a power of two <= 128) splits per head
// (grid_counter's layout: SPLIT_COUNTERS = 16, then runs of BLOCKS = 128 words)
__device__ __forceinline__ u32* split_counter(u32* ctr, int splits, int h) {
    return ctr + 16 + 128 * (31 - __clz(splits)) + h;
}

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(u64* bar, u32 bytes) {   // one arrival + bytes
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(sa(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(sa(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n"
                     " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(sa(bar)), "r"(parity) : "memory");
    }
}
// n bytes (a multiple of 16, 16-byte aligned ends) global -> shared, completing on bar
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 n, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];" :: "r"(dst), "l"(src), "r"(n), "r"(sa(bar)) : "memory");
}
// n bytes (a multiple of 16, 16-byte aligned) global -> L2, nothing waits on it
__device__ __forceinline__ void l2_prefetch(const void* src, u32 n) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(src), "r"(n) : "memory");
}
// one box of a 2-D tensor map at (x: inner, y: row) -> shared, completing on bar
__device__ __forceinline__ void tensor_copy(u32 dst, const TMap* map, int x, int y, u64* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"((u64)map), "r"(x), "r"(y), "r"(sa(bar)) : "memory");
}
__device__ __forceinline__ void ldsm4(u32 addr, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr));
}
__device__ __forceinline__ void ldsm4_t(u32 addr, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(addr));
}
// d += a (16 x 16, row) * b (16 x 8, col): bf16 in, float32 accumulators
__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
