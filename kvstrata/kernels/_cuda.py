"""What the CUDA C++ kernels share (:mod:`.decode_segment`, :mod:`.verify_segment`,
:mod:`.stream_gemv`, :mod:`.stream_rows`).

The segments are one cooperative launch of :data:`BLOCKS` blocks (one per SM, all resident),
the stream products a plain launch of one block per SM; all are compiled at run time with the
NVRTC bundled in torch (``torch.cuda._compile_kernel``) and launched through the driver
(``cuLaunchCooperativeKernel`` / ``cuLaunchKernel`` / ``cuLaunchKernelEx``, which CUDA-graph
capture records like any launch).
This module holds the device helpers their sources start with (:data:`PRELUDE`: bf16 bits,
loads through L2, the grid barrier, mbarriers, bulk and tensor copies, ``ldmatrix`` and the
bf16 ``mma``; :data:`WGMMA`: Hopper warpgroup products), the launcher (:class:`Kernel`), the
grid barriers' counters (:func:`grid_counter`), Hopper tensor maps (:func:`tensor_map_2d`), the
device check (:func:`device_ok`) and the gate both segments' ``*_ok`` functions start with
(:func:`enabled`, :func:`compiles`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from typing import Callable

import torch
from torch import Tensor

#: blocks of a launch: one per SM of an H100/H200 (132 SMs; 128 divides every split count)
BLOCKS = 128

#: Device helpers (plain CUDA C++, no ``%`` formatting). A source defines ``STAMPS`` (0/1)
#: before it; ``STAMP(k)`` then writes ``%globaltimer`` into ``stamps[block * 16 + k]``.
PRELUDE = r"""
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
"""


#: Hopper warpgroup products (``wgmma``; a source using them compiles for sm_90a: ``Kernel(...,
#: arch="90a")``), plain CUDA C++ like :data:`PRELUDE` and placed after it.
WGMMA = r"""
// Hopper warpgroup products (sm_90a). A shared-memory matrix descriptor: start address,
// leading and stride byte offsets (16-byte units), the 128-byte swizzle.
__device__ __forceinline__ u64 gdesc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32)
           | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// the accumulators as operands of an empty volatile asm: the compiler keeps their reads and
// writes on the right side of the fences and waits
__device__ __forceinline__ void wg_keep8(float* d) {
#pragma unroll
    for (int k = 0; k < 8; ++k) asm volatile("" : "+f"(d[k]) :: "memory");
}
__device__ __forceinline__ void wg_keep64(float* d) {
#pragma unroll
    for (int k = 0; k < 64; ++k) asm volatile("" : "+f"(d[k]) :: "memory");
}
// d (m64n16, float32) = / += a (registers, the warp's 16 rows x k16) * B (K-major, desc)
template <int ACC> __device__ __forceinline__ void wg_s(float* d, const u32* a, u64 desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, "
                 "p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(ACC));
}
// d (m64n128, float32) += a (registers) * B (MN-major: transposed, desc)
__device__ __forceinline__ void wg_pv(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, "
                 "%14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
                 "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
                 "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
                 "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                   "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
}
"""

class Kernel:
    """A compiled kernel and its dynamic shared memory; each call is one launch of ``blocks``
    blocks of ``threads`` on the current stream (a cooperative launch unless ``cooperative``
    is False). Arguments: tensors (their addresses), ``ctypes`` scalars, or a tensor map
    (:func:`tensor_map_2d`, by value)."""

    def __init__(self, src: str, name: str, smem: int, threads: int, arch: str | None = None,
                 blocks: int = BLOCKS, cooperative: bool = True):
        from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library
        self._check = _check_cuda
        self._lib = _get_gpu_runtime_library()
        # arch: NVRTC's target (e.g. "90a" for warpgroup products); None: the device's own
        self._k = torch.cuda._compile_kernel(src, name, compute_capability=arch,
                                             nvcc_options=["-std=c++17"])
        self._k.set_shared_memory_config(smem)
        self.smem, self.threads = smem, threads
        self.blocks, self.cooperative = blocks, cooperative

    def __call__(self, args: list, pdl: bool = False) -> None:
        """One launch; ``pdl``: as a programmatic dependent launch too (the kernel may start
        once the previous kernel on the stream lets its dependents launch, and must
        ``griddepcontrol.wait`` before it reads what that kernel wrote)."""
        vals = [a if isinstance(a, (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
                                    ctypes.c_float, ctypes.Array))
                else ctypes.c_void_p(a.data_ptr()) for a in args]
        params = (ctypes.c_void_p * len(vals))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        u = ctypes.c_uint
        if not pdl:
            dims = (u(self.blocks), u(1), u(1), u(self.threads), u(1), u(1), u(self.smem))
            if self.cooperative:
                self._check(self._lib.cuLaunchCooperativeKernel(self._k.func, *dims, stream,
                                                                params))
            else:
                self._check(self._lib.cuLaunchKernel(self._k.func, *dims, stream, params, None))
            return
        attrs = (_LaunchAttribute * 2)()
        attrs[0].id, attrs[0].value = _ATTR_PROGRAMMATIC_SERIALIZATION, 1
        attrs[1].id, attrs[1].value = _ATTR_COOPERATIVE, 1
        cfg = _LaunchConfig(self.blocks, 1, 1, self.threads, 1, 1, self.smem, stream,
                            ctypes.cast(attrs, ctypes.c_void_p), 1 + self.cooperative)
        self._check(self._lib.cuLaunchKernelEx(ctypes.byref(cfg), self._k.func, params, None))


# cuda.h's CUlaunchAttribute (an int id, padding to 8 bytes, a 64-byte value union whose
# first int is the value of both attributes used here) and CUlaunchConfig
_ATTR_COOPERATIVE = 2                      # CU_LAUNCH_ATTRIBUTE_COOPERATIVE
_ATTR_PROGRAMMATIC_SERIALIZATION = 6       # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_int), ("value", ctypes.c_int),
                ("_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint),
                ("block_z", ctypes.c_uint), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("num_attrs", ctypes.c_uint)]


#: Grid-barrier counters per (device, stream) of the launch or capture: int32, they only grow,
#: and are never freed (a captured graph keeps using its own). Launches on two streams may run
#: at once; each stream's counters see only their own launches' arrivals. Word 0: the grid
#: barrier (:data:`BLOCKS` arrivals each); from word :data:`SPLIT_COUNTERS` on, 8 runs of
#: :data:`BLOCKS` words, run ``log2(s)`` holding one word per KV head for launches of ``s``
#: splits per head (``s`` arrivals each, so a launch's target is the next multiple of ``s``
#: and launches of other split counts never share a word): the PRELUDE's ``split_counter``.
_COUNTERS: dict[tuple[torch.device, int], Tensor] = {}
SPLIT_COUNTERS = 16


def grid_counter(device: torch.device) -> Tensor:
    """The current stream's grid-barrier counters on ``device`` (the layout above)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(SPLIT_COUNTERS + 8 * BLOCKS, dtype=torch.int32,
                                         device=device)
    return c


@functools.lru_cache(maxsize=None)
def device_ok(device: torch.device) -> bool:
    """An sm_90 GPU with at least :data:`BLOCKS` SMs, and a torch that compiles CUDA C++."""
    p = torch.cuda.get_device_properties(device)
    return (p.major == 9 and p.multi_processor_count >= BLOCKS
            and hasattr(torch.cuda, "_compile_kernel"))


def enabled(impl: str, device: torch.device, env: str, default: str) -> bool:
    """Whether a segment may serve: ``impl="auto"`` on a :func:`device_ok` GPU, and the
    switch ``env`` (``default`` when unset) not ``0``."""
    return (impl == "auto" and device.type == "cuda" and os.environ.get(env, default) != "0"
            and device_ok(device))


def variant(given: str, shipped: tuple[int, ...], what: str) -> tuple[int, ...]:
    """A segment's switches from ``given`` (colon-separated integers; the ones left out as
    ``shipped``), for benchmarks; ``what`` names the source in the error."""
    try:
        head = tuple(int(x) for x in given.split(":")) if given else ()
    except ValueError:
        raise ValueError(f"{what}={given!r}: colon-separated integers, e.g. "
                         f"{':'.join(map(str, shipped))}") from None
    return head + shipped[len(head):]


def compiles(build: Callable[[], object], what: str, fallback: str) -> bool:
    """Runs ``build`` (a kernel's compile, before any graph capture needs it); a failure
    (NVRTC or the driver refused) warns ``what (error); fallback`` and returns False."""
    try:
        build()
        return True
    except Exception as e:   # noqa: BLE001 - the Triton path serves instead
        warnings.warn(f"{what} ({e}); {fallback}", RuntimeWarning, stacklevel=3)
        return False


#: CUtensorMap enums (cuda.h)
_BF16, _SWIZZLE_128B, _L2_PROMOTION_128B = 9, 3, 2
_MAPS: dict[tuple, ctypes.Array] = {}
_MAPS_MAX = 4096


def tensor_map_2d(t: Tensor, box_rows: int, box_cols: int) -> ctypes.Array:
    """A tensor map over the bf16 tensor ``t`` seen as rows of its last dimension (contiguous,
    or a 2-D tensor whose rows are 16-byte aligned and whose columns are contiguous), boxes of
    ``box_rows x box_cols`` (``box_cols * 2 == 128`` bytes: the 128-byte swizzle, so
    ``ldmatrix`` reads of 8 rows hit 8 different bank groups: chunk ``c`` of row ``r`` lands at
    chunk ``c ^ (r % 8)``); a box's rows past the tensor's land as zeros. Cached per (address,
    shape, row stride): a pool keeps its storage."""
    cols = t.shape[-1]
    rows_aligned = t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 8 == 0
    if rows_aligned:
        rows, stride = t.shape[0], t.stride(0)
    else:
        rows, stride = t.numel() // max(cols, 1), cols
    key = (t.data_ptr(), rows, cols, stride, box_rows, box_cols)
    m = _MAPS.get(key)
    if m is None:
        if (t.dtype != torch.bfloat16 or not (rows_aligned or t.is_contiguous())
                or box_cols * 2 != 128 or rows >= 2 ** 31 or not 0 < box_rows <= 256):
            raise ValueError(f"tensor_map_2d: a bf16 tensor below 2**31 rows (contiguous, or "
                             f"2-D with 16-byte aligned rows), 64-column boxes of 1-256 rows, "
                             f"got {t.dtype} {tuple(t.shape)}, box {box_rows} x {box_cols}")
        from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library
        m = (ctypes.c_uint64 * 16)()
        dims = (ctypes.c_uint64 * 2)(cols, rows)
        strides = (ctypes.c_uint64 * 1)(stride * 2)
        box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
        one = (ctypes.c_uint32 * 2)(1, 1)
        _check_cuda(_get_gpu_runtime_library().cuTensorMapEncodeTiled(
            ctypes.byref(m), ctypes.c_int(_BF16), ctypes.c_uint32(2),
            ctypes.c_void_p(t.data_ptr()), dims, strides, box, one, ctypes.c_int(0),
            ctypes.c_int(_SWIZZLE_128B), ctypes.c_int(_L2_PROMOTION_128B), ctypes.c_int(0)))
        if len(_MAPS) >= _MAPS_MAX:   # eager steps' inputs: new addresses, bounded
            _MAPS.pop(next(iter(_MAPS)))
        _MAPS[key] = m
    return m
