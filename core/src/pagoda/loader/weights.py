"""Weight sources for `model.load_weights`: safetensors folders, or deterministic random values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

DUMMY_RANGE = 1e-3


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
    """(Hugging Face name, tensor) for every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


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
