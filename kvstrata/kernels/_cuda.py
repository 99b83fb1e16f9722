"""What the CUDA C++ kernels share (:mod:`.decode_segment`, :mod:`.verify_segment`,
:mod:`.stream_gemv`, :mod:`.stream_rows`).

The segments are one cooperative launch of :data:`BLOCKS` blocks (one per SM, all resident),
the stream products a plain launch of one block per SM; all are compiled at run time with the
NVRTC bundled in torch (``torch.cuda._compile_kernel``) and launched through the driver
(``cuLaunchCooperativeKernel`` / ``cuLaunchKernel`` / ``cuLaunchKernelEx``, which CUDA-graph
capture records like any launch).
Their CUDA C++ is in ``cuda/`` beside this module: a ``.cu`` file per kernel and the helpers
they include (``prelude.cuh``: bf16 bits, loads through L2, the grid barrier, mbarriers, bulk
and tensor copies, ``ldmatrix`` and the bf16 ``mma``; ``wgmma.cuh``: Hopper warpgroup
products). This module holds what turns a file into the source of one shape
(:func:`cuda_source`), the launcher (:class:`Kernel`), the grid barriers' counters
(:func:`grid_counter`), Hopper tensor maps (:func:`tensor_map_2d`), the device check
(:func:`device_ok`) and the gate both segments' ``*_ok`` functions start with (:func:`enabled`,
:func:`compiles`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import warnings
from importlib import resources
from typing import Callable

import torch
from torch import Tensor

#: blocks of a launch: one per SM of an H100/H200 (132 SMs; 128 divides every split count)
BLOCKS = 128

#: the kernels' CUDA C++: ``<name>.cu`` (a kernel) and ``<name>.cuh`` (what they include)
_SOURCES = resources.files(__package__).joinpath("cuda")
_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.M)


def cuda_source(name: str, defines: dict[str, int]) -> str:
    """The CUDA C++ that NVRTC compiles for the kernel ``cuda/<name>``: one ``#define NAME
    value`` line per entry of ``defines`` (its shape and switches; e.g. ``{"NKV": 8}``), then
    the file with each ``#include "x.cuh"`` replaced by that file of ``cuda/`` (torch's NVRTC
    call takes no header files)."""
    return "".join(f"#define {k} {int(v)}\n" for k, v in defines.items()) + _expanded(name)


@functools.lru_cache(maxsize=None)
def _expanded(name: str) -> str:
    text = _SOURCES.joinpath(name).read_text()
    return _INCLUDE.sub(lambda m: _expanded(m.group(1)), text)


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
#: and launches of other split counts never share a word): ``split_counter`` of
#: ``cuda/prelude.cuh``.
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
