"""Loading Hugging Face checkpoint directories: ``config.json`` plus safetensors weights.

Reads a single ``model.safetensors``, a sharded checkpoint with ``model.safetensors.index.json``,
or (no index) every ``*.safetensors`` file of the directory. The safetensors format is small enough
to parse here (8-byte little-endian header length, a JSON header of ``name -> {dtype, shape,
data_offsets}``, then raw little-endian bytes), which keeps safetensors an optional dependency;
files are memory-mapped copy-on-write, so nothing is read until a tensor is used.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be loaded (missing, malformed, wrong model)."""


def read_config(path: str | os.PathLike) -> dict:
    """``config.json`` of a Hugging Face model directory as a dict (clear errors otherwise)."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory; pass a Hugging Face model directory "
                              "(config.json + *.safetensors)")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{d} has no config.json; is it a Hugging Face model directory?")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg} is not valid JSON: {e}") from None


def load_safetensors_file(path: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of one ``.safetensors`` file (memory-mapped CPU tensors)."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{p} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{p}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{p}: malformed safetensors header: {e}") from None
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else b""
    out: dict[str, Tensor] = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise CheckpointError(f"{p}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
        shape = [int(s) for s in info["shape"]]
        start, end = (int(o) for o in info["data_offsets"])
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dt).element_size()
        if end - start != numel * itemsize or base + end > size:
            raise CheckpointError(f"{p}: tensor {name!r} {shape} {info['dtype']} has a byte range "
                                  f"[{start}, {end}) that does not match its shape or the file")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dt)
            continue
        out[name] = torch.frombuffer(buf, dtype=dt, count=numel, offset=base + start).view(shape)
    return out


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model directory, in load order."""
    d = Path(path)
    index = d / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e!r}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are not in {d}: {missing}")
        return [d / f for f in files]
    if (d / SINGLE_NAME).is_file():
        return [d / SINGLE_NAME]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
        hint = f" (found {bins[:3]}: convert them to safetensors)" if bins else ""
        raise CheckpointError(f"{d} holds no *.safetensors weights{hint}")
    return files


def load_safetensors_dir(path: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of a model directory's safetensors weights, by checkpoint name.

    Handles a single ``model.safetensors`` and sharded checkpoints with
    ``model.safetensors.index.json``. Raises :class:`CheckpointError` (a ``ValueError``) for a
    missing directory, missing shards, malformed files or a tensor present in two shards.
    """
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory")
    out: dict[str, Tensor] = {}
    for f in checkpoint_files(d):
        for name, t in load_safetensors_file(f).items():
            if name in out:
                raise CheckpointError(f"tensor {name!r} appears in more than one shard of {d}")
            out[name] = t
    return out


__all__ = ["CheckpointError", "checkpoint_files", "load_safetensors_dir", "load_safetensors_file",
           "read_config"]


def weights_fingerprint(config_text: str, tensors: Mapping[str, Tensor]) -> str:
    """Hex BLAKE2b-128 of a model's config text and every tensor's name, dtype, shape and bytes.

    It goes into the prefix-cache namespace, so two models that differ anywhere (a fine-tune
    changes every weight by a little) never share pages; reading every byte costs about a second
    per GB, once at load time.
    """
    from ..dtypes import dtype_name
    h = hashlib.blake2b(digest_size=16)
    h.update(config_text.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{dtype_name(t.dtype)}|{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
