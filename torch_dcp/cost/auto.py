"""``cost_model="auto"``: the cost model of the device a step runs on.

In order:

1. the file named by ``TORCH_DCP_COST_MODEL`` (a JSON model, e.g. written by ``python -m
   torch_dcp.benchmarks calibrate --out FILE``);
2. this device's calibration in the per-user cache (:func:`cache_path`: the device's name and
   the torch version; ``calibrate`` writes it there by default);
3. the shipped preset matching the device's name: H100 and H200 -> the ``h100`` kernel table, A100
   -> ``a100``, each with the executor's fixed costs per division measured on a GPU
   (:data:`~torch_dcp.cost.model.GPU_EXECUTOR`);
4. otherwise -- a CPU, or a GPU of another name -- a shipped model measured on another machine
   (the CPU: a 2-core x86 machine's calibration, ``presets/cpu.json``; another GPU: the ``h100``
   preset), with a warning that names the command that calibrates this device. Never the H100
   model on a CPU.

The model's :attr:`~torch_dcp.cost.CostModel.source` says which one it is; :func:`resolve` logs
it (logger ``torch_dcp``) the first time it is resolved in a process.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import warnings
from pathlib import Path
from typing import Any

from .model import CostModel

__all__ = ["resolve", "cache_path", "device_key", "device_name", "ENV_VAR", "CACHE_VAR", "CALIBRATE_COMMAND", "PRESET_DIR"]

#: the variable naming a cost-model file that ``"auto"`` uses before anything else
ENV_VAR = "TORCH_DCP_COST_MODEL"
#: the variable naming the folder of calibrated models (default: the user's cache folder)
CACHE_VAR = "TORCH_DCP_COST_CACHE"
#: the command that calibrates this device (named by the fallback's warning)
CALIBRATE_COMMAND = "python -m torch_dcp.benchmarks calibrate"
#: the shipped models
PRESET_DIR = Path(__file__).with_name("presets")
_log = logging.getLogger("torch_dcp")
_seen: set[tuple[str, str]] = set()


def _device(device: Any) -> Any:
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: Any = None) -> str:
    """The GPU's name on CUDA, else ``"cpu"`` and the processor's model."""
    import torch

    dev = _device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu {_cpu_name()}"


def device_key(device: Any = None) -> str:
    """The cache key of ``device``: its name and the torch version, as a file name."""
    import torch

    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{device_name(device)}-torch{torch.__version__}").strip("_")


def cache_path(device: Any = None) -> Path:
    """Where ``calibrate`` stores and ``"auto"`` finds ``device``'s model:
    ``$XDG_CACHE_HOME/torch_dcp/cost/<device_key>.json`` (``~/.cache`` by default), or
    ``$TORCH_DCP_COST_CACHE/<device_key>.json``."""
    root = os.environ.get(CACHE_VAR)
    if root:
        return Path(root) / f"{device_key(device)}.json"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "torch_dcp" / "cost" / f"{device_key(device)}.json"


def _announce(model: CostModel, how: str) -> CostModel:
    key = (how, model.source)
    if key not in _seen:
        _seen.add(key)
        _log.info("torch_dcp plans with the cost model %s (%s)", model.source, how)
    return model


def resolve(device: Any = None) -> CostModel:
    """The cost model ``"auto"`` stands for on ``device`` (default: CUDA where available, else
    the CPU); see the module docstring for the order.

    Raises:
        ValueError: ``TORCH_DCP_COST_MODEL`` names a file that is missing or malformed.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        if not Path(env).is_file():
            raise ValueError(f"{ENV_VAR}={env!r}: no such file (a cost model JSON, e.g. from '{CALIBRATE_COMMAND} "
                             f"--out FILE')")
        return _announce(CostModel.load(env), f"from {ENV_VAR}")
    dev = _device(device)
    path = cache_path(dev)
    if path.is_file():
        return _announce(CostModel.load(str(path)), f"calibrated, {path}")
    name = device_name(dev)
    for pattern, preset in (("H100", "h100"), ("H200", "h100"), ("A100", "a100")):
        if dev.type == "cuda" and pattern in name.upper():
            return _announce(CostModel.load(f"{preset}-executor"), f"shipped preset for {name}")
    if dev.type == "cuda":
        model = CostModel.load("h100-executor")
    else:
        model = CostModel.load(str(PRESET_DIR / "cpu.json"))
    key = ("uncalibrated", name)
    if key not in _seen:
        _seen.add(key)
        warnings.warn(f"torch_dcp: no cost model calibrated for {name}; planning with {model.source}. Run "
                      f"'{CALIBRATE_COMMAND}' once on this machine (a few minutes) for plans chosen by this "
                      f"device's own costs.", RuntimeWarning, stacklevel=3)
    return _announce(model, f"fallback for {name}")
