"""The CUDA C++ of kernels/cuda (the persistent segments, kernels.decode_segment and
kernels.verify_segment; the stream products' files are compiled in test_stream_gemv) compiled
on the CPU by NVRTC (the ``nvidia-cuda-nvrtc-cu12`` wheel of the dev extras; no GPU, no driver):
every shape class the ``*_ok`` functions serve builds for its target (``sm_90``, the warpgroup
build ``sm_90a``) as shipped and with the benchmarks' switches, its PTX keeps every array in
registers (no local memory), and ptxas (inside NVRTC) spills none of them (the verify segment's
9 warps per block cap it at 168 registers per thread: 3 warps share one of the SM's four
register files). CI has no GPU, so this is where a source edit that does not
compile fails; the GPU tests (``-m gpu``) check the values."""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re

import pytest

from kvstrata.kernels import _cuda
from kvstrata.kernels import decode_segment as ds
from kvstrata.kernels import stream_gemv as sg
from kvstrata.kernels import stream_rows as sr
from kvstrata.kernels import verify_segment as vs


@functools.lru_cache(maxsize=None)
def _nvrtc():
    try:
        import nvidia.cuda_nvrtc as pkg
    except ImportError:
        return None
    libs = sorted(glob.glob(os.path.join(list(pkg.__path__)[0], "lib", "libnvrtc.so.*")))
    libs = [p for p in libs if "builtins" not in p and ".alt." not in p]
    return ctypes.CDLL(libs[0]) if libs else None


def _compile(src: str, arch: str) -> tuple[str, str]:
    """PTX of ``src`` for ``sm_<arch>`` and NVRTC's log (with ptxas's register and spill
    report); a compile error fails the test with the log."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("NVRTC is not installed (the dev extras' nvidia-cuda-nvrtc-cu12)")
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"segment.cu", 0, None,
                                  None) == 0
    try:
        opts = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17",
                b"--ptxas-options=-v"]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, f"NVRTC error {rc}:\n{log.value.decode(errors='replace')}"
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        ptx = ctypes.create_string_buffer(n.value)
        assert lib.nvrtcGetPTX(prog, ptx) == 0
        return ptx.value.decode(), log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(built: tuple[str, str], entry: str, threads: int, spill: int = 0) -> None:
    ptx, log = built
    assert f".entry {entry}(" in ptx
    assert f".maxntid {threads}, 1, 1" in ptx
    assert ".local" not in ptx, "an array left registers (local memory in the PTX)"
    stores = re.findall(r"(\d+) bytes spill stores", log)
    assert stores, f"no ptxas report in NVRTC's log:\n{log}"
    assert max(map(int, stores)) <= spill, f"ptxas spilled registers:\n{log}"


# (KV heads, query heads per KV head, o_proj in, o_proj out): Qwen3-8B's layer, a 16-head
# 2048-wide one (Qwen3-1.7B's attention), a 2-KV-head hidden-1024 one (the GPU tests' small
# model: 64 splits per head, 8 o_proj rows per block)
DECODE_SHAPES = [(8, 4, 4096, 4096), (8, 2, 2048, 2048), (2, 4, 1024, 1024)]


@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_segment_compiles(shape):
    """Each page's two attention products run on tensor cores: 8 ``mma`` for K q^T and 8 for
    V^T P^T, in the loop body once (the segment's page loop is not unrolled)."""
    src, _ = ds.build(*shape, *ds.VARIANT, False)
    ptx, log = _compile(src, "90")
    _check((ptx, log), "decode_segment", ds.WARPS * 32)
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 16


@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_attention_alone_compiles(shape):
    """``decode_attention``'s build: phases 2-3 only (no o_proj rows, no second barrier)."""
    nkv, group = shape[:2]
    src, rs = ds.attention_build(nkv, group, *ds.ATTENTION_VARIANT)
    assert rs == 0 and "#define ATTN_ONLY 1" in src
    ptx, log = _compile(src, "90")
    _check((ptx, log), "decode_segment", ds.WARPS * 32)
    assert ptx.count("bar.sync") <= _compile(ds.build(*shape, *ds.VARIANT, False)[0],
                                             "90")[0].count("bar.sync")


@pytest.mark.parametrize("switches", [
    (24, 1, 0, 1, 0, 0, 0, True), (16, 0, 1, 0, 0, 0, 0, False), (0, 0, 2, 0, 0, 0, 0, False),
    (16, 0, 2, 1, 1, 0, 0, True), (16, 0, 2, 1, 0, 1, 0, False), (16, 0, 2, 1, 0, 0, 1, True),
    (16, 1, 2, 1, 0, 0, 1, False)])
def test_decode_segment_benchmark_switches_compile(switches):
    """``segment_proto.py``'s variants: rows in registers after barrier 1, the rows' other
    start points, no rows in shared memory, the PDL launch, each split's pages contiguous or
    its loop one page per trip, the merge after the head's splits alone (with the rows in
    registers once a block has merged), the phase timestamps."""
    src, rs = ds.build(8, 4, 4096, 4096, *switches)
    assert rs == switches[0]
    _check(_compile(src, "90"), "decode_segment", ds.WARPS * 32)


@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("switches", [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1),
                                      (1, 1, 1), (1, 2, 1)])
@pytest.mark.parametrize("attn_only", [True, False])
def test_decode_switches_compile(shape, switches, attn_only):
    """Both builds (``decode_attention``'s and the segment as shipped otherwise) with each
    split's pages contiguous or dealt round robin, the page loop one or two pages per trip, the
    merge after a grid barrier or after the head's splits alone, in every decode shape,
    without spills: one wait before the merge (the segment has a second grid barrier before
    o_proj); the loop's 16 products twice where it is unrolled."""
    nkv, group, k_in, n_out = shape
    pages, unroll, hwait = switches
    # the segment ships hwait off (no faster in the step, thirty-fifth runner session); in
    # the 2-KV-head shape its hwait builds spill (8 and 52 bytes with this NVRTC)
    spill = 64 if hwait and not attn_only and shape != DECODE_SHAPES[0] else 0
    if attn_only:
        src, _ = ds.attention_build(nkv, group, pages, unroll, hwait)
    else:
        src, _ = ds.build(*shape, *ds.VARIANT[:4], pages, unroll, hwait, False)
    ptx, log = _compile(src, "90")
    _check((ptx, log), "decode_segment", ds.WARPS * 32, spill)
    assert "atom.global.add" not in ptx
    waits = ptx.count("ld.acquire.gpu")      # the waits before the merge and o_proj
    assert waits == (1 if attn_only else 2)
    assert ptx.count("atom.add.release.gpu.global") == (1 if attn_only else 2)
    assert ptx.count("mma.sync.aligned.m16n8k16") == 16 * (1 + (unroll == 1))


@pytest.mark.parametrize("shape", DECODE_SHAPES[:2])
@pytest.mark.parametrize("pages", [0, 1])
def test_decode_attention_with_12_warps_compiles(shape, pages):
    """The attention-only build with 12 warps per block and each page loaded then used (the
    page loop's registers for one page: 12 warps cap a thread at 168) in the 8-KV-head shapes,
    without spills."""
    nkv, group = shape[:2]
    src, _ = ds.attention_build(nkv, group, pages, 2, 1, 12)
    ptx, log = _compile(src, "90")
    _check((ptx, log), "decode_segment", 12 * 32)
    assert ptx.count("mma.sync.aligned.m16n8k16") == 16


# the warpgroup build (4 query heads per KV head: Qwen3-8B, and 4 KV heads at 2048) and the
# mma build (2 and 8 query heads per KV head)
VERIFY_SHAPES = [(8, 4, 4096, 4096), (4, 4, 2048, 2048), (8, 2, 2048, 4096), (2, 8, 2048, 2048)]


@pytest.mark.parametrize("shape", VERIFY_SHAPES)
def test_verify_segment_compiles(shape):
    src, arch = vs.build(*shape, *vs.VARIANT, False)
    assert arch == ("90a" if shape[1] == 4 else "90")
    # no shape spills (8 query heads per KV head on the mma build spilled 8-16 bytes per thread
    # until the grid merge issued all its loads at once, twenty-fifth runner session)
    _check(_compile(src, arch), "verify_segment", vs.THREADS)


@pytest.mark.parametrize("mod", [ds, vs])
def test_segments_wait_for_the_previous_kernel_only_as_pdl_launches(mod):
    """The shipped builds are programmatic dependent launches (``griddepcontrol.wait`` before
    q, the residual and the newest pages); with the switch off the source has no wait."""
    head = (8, 4, 4096, 4096)
    on, arch = mod.build(*head, *mod.VARIANT, False)
    off, _ = mod.build(*head, *mod.VARIANT[:3], 0, *mod.VARIANT[4:], False)
    assert mod.VARIANT[3] == 1
    arch = arch if isinstance(arch, str) else "90"
    assert "griddepcontrol.wait" in _compile(on, arch)[0]
    assert "griddepcontrol" not in _compile(off, arch)[0]


def test_verify_segment_page_loop_rescales_lazily_as_shipped():
    """The shipped page loop moves its running maxima on one warp vote per page and takes its
    exponentials without denormals (``lazy``, twenty-eighth runner session); the eager build
    rescales every page with neither."""
    assert vs.VARIANT[4:] == (1, 1)
    on, arch = vs.build(8, 4, 4096, 4096, *vs.VARIANT, False)
    off, _ = vs.build(8, 4, 4096, 4096, *vs.VARIANT[:4], 0, 1, False)
    ptx_on, ptx_off = _compile(on, arch)[0], _compile(off, arch)[0]
    assert "vote.sync.any.pred" in ptx_on and "ex2.approx.ftz.f32" in ptx_on
    assert "vote.sync.any" not in ptx_off and "ex2.approx.ftz.f32" not in ptx_off


def test_verify_segment_benchmark_switches_compile():
    """The L2 prefetch, a deeper ring, the page loop's eager rescale, the weight rows after
    the last page and the timestamps (``segment_proto.py --queries``)."""
    src, arch = vs.build(8, 4, 4096, 4096, 10, 1, 1, 1, 0, 0, True)
    _check(_compile(src, arch), "verify_segment", vs.THREADS)


def _kernel_sources() -> list[tuple[str, str, str]]:
    """(file, source, NVRTC target) of each kernel file in ``kernels/cuda`` as shipped."""
    return [("decode_segment.cu", ds.build(*DECODE_SHAPES[0], *ds.VARIANT, False)[0], "90"),
            ("verify_segment.cu", *vs.build(*VERIFY_SHAPES[0], *vs.VARIANT, False)),
            ("stream_gemv.cu", sg.build(4096, 4096, 132, False, True, False, 8, 192, 1, 1)[0],
             "90"),
            ("stream_rows.cu", sr.build_rows(4096, 4096, 132, True, False, 8, 192, 64, 1, 1)[0],
             "90")]


def test_kernel_files_are_built_with_their_defines_and_includes_in_place():
    """A launcher's source is one ``#define`` per shape constant and switch, then its file of
    ``kernels/cuda`` with every ``#include`` expanded (NVRTC gets no header files): each
    ``.cuh`` once, nothing left to include, and every ``.cu`` of the folder built by one
    launcher."""
    folder = _cuda._SOURCES
    files = sorted(f.name for f in folder.iterdir() if f.name.endswith(".cu"))
    built = _kernel_sources()
    assert sorted(name for name, _, _ in built) == files
    for name, src, _ in built:
        head, body = src.split("\n// ", 1)[0], folder.joinpath(name).read_text()
        assert all(line.startswith("#define ") for line in head.splitlines()), name
        assert "\n#include" not in src and src.count("typedef unsigned short bf16_t;") == 1
        for line in body.splitlines():
            if line.startswith("#include"):
                header = line.split('"')[1]
                assert folder.joinpath(header).read_text() in src, (name, header)
    assert "wgmma.cuh" in folder.joinpath("verify_segment.cu").read_text()


@pytest.mark.parametrize("case", range(4))
def test_a_kernel_file_built_without_a_define_says_so(case):
    """Each ``.cu`` names the defines it needs: compiled without the first one, NVRTC's error
    says which launcher builds it (not an undeclared identifier deep in the kernel)."""
    name, src, arch = _kernel_sources()[case]
    head, rest = src.split("\n", 1)
    assert head.startswith("#define ")
    with pytest.raises(AssertionError, match="built by kvstrata.kernels." + name[:-3]):
        _compile(rest, arch)


def test_a_shape_compiles_once():
    """Both launchers keep their compiled kernels per shape and switches: a compile (NVRTC,
    ~1 s) must never run per call, nor inside a CUDA-graph capture (the ``*_ok`` functions
    compile first)."""
    for mod in (ds, vs):
        assert hasattr(mod._kernel, "cache_info"), f"{mod.__name__}._kernel is not cached"
