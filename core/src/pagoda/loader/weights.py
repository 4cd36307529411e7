"""Weight sources for `model.load_weights`: safetensors folders, or deterministic random values."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

DUMMY_RANGE = 1e-3
# Elements of a parameter that init_dummy_ computes at once on an accelerator: bounds its scratch
# memory (20 bytes an element) while keeping the kernels large enough that launches cost nothing.
DUMMY_CHUNK = 2**24
# The same on the CPU, where a chunk whose scratch stays in the caches took half the time.
DUMMY_CPU_CHUNK = 2**20
_MASK64 = 2**64 - 1
# splitmix64's increment (the golden ratio in 64 bits) and its finaliser's multipliers.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
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
def init_dummy_(module: nn.Module, seed: int = 0, chunk: int | None = None) -> None:
    """Fill every parameter with uniform values in ``±DUMMY_RANGE``, the same for the same seed,
    parameter name and shape on every device.

    Parameters named like norm weights (`...norm.weight`) are set to 1 so that activations keep
    their scale. Element ``i`` of parameter ``name`` takes the top 24 bits of splitmix64 at index
    ``i`` of a stream keyed by ``seed`` and ``name`` (:func:`_dummy_key`): integer arithmetic
    that is exact everywhere, then one float32 product, then the cast to the parameter's dtype,
    all of which round alike on the CPU and a GPU, so the values do not depend on the device.

    NOTE: computed on the parameter's own device, ``chunk`` elements at a time (default
    :data:`DUMMY_CHUNK`, :data:`DUMMY_CPU_CHUNK` on the CPU; 20 bytes of scratch each; the values
    do not depend on it): drawn on the CPU with one generator and copied over, a Qwen3-30B-A3B
    shaped model (about 30 billion parameters) took 256 s to start, almost all of it drawing.
    """
    drawn = []
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif param.numel():
            drawn.append((name, param))
    # One chunk's scratch per device, reused by every parameter there: as large as the largest
    # chunk it serves, so that a small model's parameters take no more.
    chunks = {p.device: chunk or _default_chunk(p.device) for _, p in drawn}
    sizes: dict[torch.device, int] = {}
    for _, param in drawn:
        size = min(chunks[param.device], param.numel())
        sizes[param.device] = max(sizes.get(param.device, 0), size)
    scratch = {
        device: (
            torch.empty(size, dtype=torch.int64, device=device),
            torch.empty(size, dtype=torch.int64, device=device),
            torch.empty(size, dtype=torch.float32, device=device),
        )
        for device, size in sizes.items()
    }
    # NOTE: DUMMY_RANGE rounded to float32, times a power of two: a float32 value, so the one
    # product in _dummy_chunk_ is rounded once, the same on every device (read here, not at
    # import, so that a test may widen the range).
    (scale,) = struct.unpack("<f", struct.pack("<f", DUMMY_RANGE))
    scale *= 2.0**-24
    for name, param in drawn:
        key = _dummy_key(name, seed)
        z, t, out = scratch[param.device]
        # NOTE: element i is the i-th in row-major order whatever the layout, so a parameter
        # that is not contiguous is drawn into a contiguous tensor and copied from it.
        target = (
            param
            if param.is_contiguous()
            else torch.empty(param.shape, dtype=param.dtype, device=param.device)
        )
        flat = target.view(-1)
        step = chunks[param.device]
        for begin in range(0, flat.numel(), step):
            n = min(step, flat.numel() - begin)
            _dummy_chunk_(out[:n], z[:n], t[:n], key, begin, scale)
            flat[begin : begin + n].copy_(out[:n])
        if target is not param:
            param.copy_(target)


def _default_chunk(device: torch.device) -> int:
    return DUMMY_CPU_CHUNK if device.type == "cpu" else DUMMY_CHUNK


def _signed(value: int) -> int:
    """The int64 whose two's complement bits are ``value``'s low 64 bits."""
    value &= _MASK64
    return value - 2**64 if value >= 2**63 else value


def _splitmix64(state: int) -> int:
    """splitmix64's output for ``state`` (already advanced), with Python's exact integers."""
    z = state & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _dummy_key(name: str, seed: int) -> int:
    """The stream of parameter ``name`` under ``seed``: from a stable hash of the name (zlib's
    CRC-32, not Python's salted ``hash``), so that a parameter's values depend on its own name
    and shape only, not on which other parameters the model holds."""
    return _splitmix64(_splitmix64(seed + _GOLDEN) ^ zlib.crc32(name.encode()))


def _dummy_chunk_(
    out: torch.Tensor, z: torch.Tensor, t: torch.Tensor, key: int, start: int, scale: float
) -> None:
    """``out`` (float32, n elements) := the values of elements ``start .. start + n`` of the
    stream ``key``, odd integers in ``(-2**24, 2**24)`` times ``scale``, with ``z`` and ``t``
    (int64, n elements) as scratch."""
    # splitmix64 over the element index: state = key + (index + 1) * golden ratio, mod 2**64.
    # NOTE: int64 products and sums wrap modulo 2**64 alike on every device, so only the logical
    # right shifts need care: torch's `>>` is arithmetic (it copies the sign bit), so each shift
    # is masked to its low 64 - s bits, which makes it logical whatever the sign.
    torch.arange(start + 1, start + 1 + z.numel(), out=z)
    z.mul_(_signed(_GOLDEN)).add_(_signed(key))
    for shift, mix in ((30, _MIX1), (27, _MIX2)):
        torch.bitwise_right_shift(z, shift, out=t)
        t.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(t).mul_(_signed(mix))
    # splitmix64's last step, z ^ (z >> 31), leaves the top 33 bits as they are: the top 24 bits
    # used below are already its output's. They make the odd integer 2k + 1 - 2**24 (k the top
    # 24 bits, unsigned), in (-2**24, 2**24) and so exact in float32, symmetric about 0.
    z.bitwise_right_shift_(39).bitwise_and_(2**25 - 1).bitwise_or_(1).sub_(2**24)
    out.copy_(z)
    # One float32 product, rounded once and the same on every device; |values| stay within
    # DUMMY_RANGE as float32 rounds it.
    out.mul_(scale)
