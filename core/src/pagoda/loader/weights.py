"""Weight sources for `model.load_weights`: safetensors folders, or deterministic random values."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

DUMMY_RANGE = 1e-3
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def safetensors_files(folder: str | Path) -> list[Path]:
    """The folder's weight files: those its index names, else every *.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing files: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no *.safetensors weights (only safetensors folders are read: "
            "convert .bin checkpoints, pass a .gguf file, or use load_format='dummy')"
        )
    return files


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor in the folder's safetensors files, in file
    order, each in memory of its own.

    NOTE: read with plain reads rather than a memory map: mapped file pages count in the
    process's resident memory on top of the parameters they are copied into, which doubled the
    peak memory of a small model's start-up.
    """
    for file in safetensors_files(folder):
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            base = 8 + header_len
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ValueError(f"{file}: {name!r} has an unsupported dtype {info['dtype']}")
                begin, end = info["data_offsets"]
                raw = torch.empty(end - begin, dtype=torch.uint8)
                f.seek(base + begin)
                if f.readinto(raw.numpy()) != end - begin:
                    raise ValueError(f"{file} is truncated: tensor {name!r} is incomplete")
                yield name, raw.view(dtype).reshape(info["shape"])


@torch.no_grad()
def init_dummy_(module: nn.Module, seed: int = 0) -> None:
    """Fill every parameter with uniform(-1e-3, 1e-3) values, the same for the same seed.

    Parameters named like norm weights (`...norm.weight`) are set to 1 so that activations keep
    their scale. Values are drawn on the CPU and copied, so they do not depend on the device.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        values = torch.empty(param.shape, dtype=torch.float32)
        values.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
        param.copy_(values)
