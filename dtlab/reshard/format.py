"""The files of a resharding checkpoint, and reading pieces back from them.

Taught in chapter 13 (:mod:`dtlab.reshard`). A checkpoint is a folder:

- ``metadata.json``, written by rank 0: the model, the layout and step it was saved
  at, the optimizer's hyper-parameters and loss scale, and for every full tensor its
  shape and its pieces, each with the :class:`~dtlab.reshard.pieces.Piece` it is,
  the file it is in, the byte offset and dtype of each array saved for it (the fp32
  master ``weight``, Adam's ``exp_avg`` and ``exp_avg_sq``: one number per element,
  like the weight) and its per-tensor numbers (Adam's ``step``);
- ``rankNNNNN.bin``, one per rank that wrote a piece: the arrays' raw bytes back to
  back, nothing else (the metadata says where each begins);
- ``rankNNNNN.rng.pt``: each rank's random state, for a load at the same layout.

:class:`PieceReader` reads a span of one array of one piece with a seek and a read,
so a loading rank touches only the bytes it needs. :func:`read_full` assembles one
full tensor from its pieces (export and tests; no process group involved) and
:func:`describe` counts what the folder holds.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from dtlab.reshard.pieces import Piece, overlaps

__all__ = [
    "FORMAT",
    "METADATA",
    "data_file",
    "random_file",
    "dtype_name",
    "read_metadata",
    "PieceReader",
    "read_full",
    "describe",
]

FORMAT = "dtlab.reshard/1"
METADATA = "metadata.json"


def data_file(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def random_file(rank: int) -> str:
    return f"rank{rank:05d}.rng.pt"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the metadata names an unknown dtype {name!r}")
    return dtype


def read_metadata(path) -> dict:
    """The checkpoint's ``metadata.json``, checked to be this format's."""
    file = os.path.join(os.fspath(path), METADATA)
    if not os.path.exists(file):
        raise ValueError(
            f"{path} holds no {METADATA}: not a dtlab.reshard checkpoint (a "
            "dtlab.checkpoint.save_training folder loads with load_training)"
        )
    with open(file, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{file} is format {meta.get('format')!r}, this reader reads {FORMAT!r}"
        )
    if meta["byteorder"] != sys.byteorder:
        raise ValueError(
            f"the checkpoint's bytes are {meta['byteorder']}-endian, this machine is "
            f"{sys.byteorder}-endian"
        )
    return meta


class PieceReader:
    """Reads spans of saved arrays from a checkpoint folder, opening each file once
    and counting the bytes it reads. Use as a context manager (closes the files)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.files: dict[str, object] = {}
        self.bytes_read = 0

    def check(self, saved: dict, name: str) -> None:
        """Raise a clear error now if the file holding ``saved`` (a piece of
        ``name``) is missing, before anything is read or written."""
        file = os.path.join(self.path, saved["file"])
        if not os.path.exists(file):
            raise ValueError(
                f"{saved['file']} is missing from {self.path}, but the metadata puts "
                f"a piece of {name} in it: the checkpoint is incomplete (copy every "
                "rankNNNNN.bin file with metadata.json)"
            )

    def copy(self, saved: dict, key: str, segments, out: torch.Tensor) -> None:
        """For each ``(offset in out, offset in the saved piece, length)`` segment,
        copy the saved piece's array ``key`` into the flat tensor ``out``. One read
        covers the span from the first segment's start to the last one's end."""
        if not segments:
            return
        offset, dtype = saved["data"][key]
        dtype = _dtype(dtype)
        size = torch.empty((), dtype=dtype).element_size()
        first = min(h for _, h, _ in segments)
        last = max(h + n for _, h, n in segments)
        f = self.files.get(saved["file"])
        if f is None:
            self.check(saved, "a tensor")
            f = self.files[saved["file"]] = open(  # noqa: SIM115 - closed in close()
                os.path.join(self.path, saved["file"]), "rb"
            )
        f.seek(offset + first * size)
        raw = f.read((last - first) * size)
        if len(raw) != (last - first) * size:
            raise ValueError(
                f"{saved['file']} ends before the bytes the metadata places in it: "
                "the file is truncated"
            )
        self.bytes_read += len(raw)
        src = torch.frombuffer(bytearray(raw), dtype=dtype)
        for w, h, n in segments:
            out[w : w + n] = src[h - first : h - first + n]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_full(path, name: str, key: str = "weight") -> torch.Tensor:
    """The full tensor ``name`` (``key``: ``"weight"``, the fp32 master, or an
    optimizer state such as ``"exp_avg"``), assembled from its pieces. Reads the
    files directly: no process group, no model."""
    meta = read_metadata(path)
    entry = meta["tensors"].get(name)
    if entry is None:
        raise ValueError(
            f"the checkpoint holds no tensor {name!r}: it holds "
            f"{sorted(meta['tensors'])[:6]}..."
        )
    if key not in entry["pieces"][0]["data"]:
        raise ValueError(
            f"{name} was saved with {sorted(entry['pieces'][0]['data'])}, not {key!r}"
        )
    whole = Piece.whole(entry["shape"])
    dtype = _dtype(entry["pieces"][0]["data"][key][1])
    out = torch.zeros(whole.numel, dtype=dtype)
    covered = 0
    with PieceReader(path) as reader:
        for saved in entry["pieces"]:
            segments = overlaps(whole, Piece.from_dict(entry["shape"], saved))
            reader.copy(saved, key, segments, out)
            covered += sum(n for _, _, n in segments)
    if covered != whole.numel:
        raise ValueError(f"the pieces of {name} cover {covered} of {whole.numel}")
    return out.view(entry["shape"])


def describe(path) -> dict:
    """What the folder holds: ``files`` (name: bytes), ``metadata_bytes``,
    ``data_bytes`` (per data file), ``random_state_bytes``, ``tensors``,
    ``pieces``, and ``payload_bytes``: the arrays' bytes as the metadata counts
    them (for an fp32 AdamW run, 12 per model parameter)."""
    path = os.fspath(path)
    meta = read_metadata(path)
    files = {
        f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))
    }
    payload = 0
    pieces = 0
    for entry in meta["tensors"].values():
        for saved in entry["pieces"]:
            pieces += 1
            numel = Piece.from_dict(entry["shape"], saved).numel
            for _, dtype in saved["data"].values():
                payload += numel * torch.empty((), dtype=_dtype(dtype)).element_size()
    return {
        "files": files,
        "metadata_bytes": files[METADATA],
        "data_bytes": {f: b for f, b in files.items() if f.endswith(".bin")},
        "random_state_bytes": sum(b for f, b in files.items() if f.endswith(".rng.pt")),
        "tensors": len(meta["tensors"]),
        "pieces": pieces,
        "payload_bytes": payload,
        "params": sum(math.prod(e["shape"]) for e in meta["tensors"].values()),
    }
