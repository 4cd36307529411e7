"""What every benchmark report carries: the commit, the hardware, and where the JSON goes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("benchmarks/results")


def commit() -> str:
    """The short commit of the working tree (``PAGODA_COMMIT`` where there is no git)."""
    if os.environ.get("PAGODA_COMMIT"):
        return os.environ["PAGODA_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def hardware(device: Any) -> str:
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def save_report(report: dict[str, Any], name: str, output_json: str | None = None) -> Path:
    """Write ``report`` to ``output_json``, or to ``benchmarks/results/<name>.json``."""
    path = Path(output_json) if output_json else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_text(report) + "\n")
    return path


def report_text(report: dict[str, Any]) -> str:
    """``report`` as JSON, with the paths of the machine it ran on made portable: under the
    working folder (a benchmark runs from the repository's root) relative to it, under the home
    folder as ``~/...``. The report travels; the machine's folders do not."""
    text = json.dumps(report, indent=2)
    home = Path.home()
    for folder, shown in ((Path.cwd(), ""), (home, "~/")):
        if folder != Path(folder.anchor) and (shown or folder != home):  # (not / nor ~ itself)
            text = text.replace(str(folder) + "/", shown)
    return text


def throughput_figures(
    elapsed: float, input_tokens: int, output_tokens: int, load_s: float
) -> dict[str, Any]:
    """An engine's figures on a workload: tokens per second of generation, loading excluded."""
    return {
        "elapsed_s": round(elapsed, 3),
        "load_s": round(load_s, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "total_tokens_per_s": round((output_tokens + input_tokens) / elapsed, 2),
    }


def versions() -> dict[str, str]:
    """The versions of the libraries a benchmark's figures depend on."""
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    out = {"torch": torch.__version__}
    try:
        # NOTE: transformers is slow to import: only where it is used.
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def slug(text: str) -> str:
    """``text`` as a file-name part: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return "-".join("".join(c if c.isalnum() or c == "." else " " for c in text).lower().split())
