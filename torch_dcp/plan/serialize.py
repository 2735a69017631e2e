"""Plan serialisation (no pickle) and the content digest.

Format: magic, format version, a JSON header (batch, topology, planner, divisions, block size
and the array table), then raw little-endian arrays -- block spans, block and tile ranks, tile
divisions in the narrowest integer types. Tiles and programs are recomputed on load.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from ..batch import BatchSpec
from ..masks import Ranges
from ..planners.base import Placement
from ..topology import Topology
from ..workload import Workload, smallest_int
from .ir import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

__all__ = ["FORMAT_MAGIC", "FORMAT_VERSION", "plan_to_bytes", "plan_from_bytes", "plan_digest"]

FORMAT_MAGIC = b"TDCPLAN\0"
FORMAT_VERSION = 2


def _content(plan: "Plan") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    arrays = dict(plan.workload.arrays())
    arrays["block_rank"] = plan.placement.block_rank.astype(smallest_int(plan.world_size))
    arrays["tile_rank"] = plan.placement.tile_rank.astype(smallest_int(plan.world_size))
    arrays["tile_division"] = plan.tile_division.astype(smallest_int(plan.divisions))
    batch = plan.batch.to_dict()
    for i, m in enumerate(plan.batch.masks):
        if isinstance(m, Ranges):
            arrays[f"mask{i}_starts"] = m.starts
            arrays[f"mask{i}_ends"] = m.ends
            batch["masks"][i] = {"type": "Ranges", "arrays": i}
    header = {
        "batch": batch,
        "topology": plan.topology.to_dict(),
        "planner": plan.planner,
        "divisions": plan.divisions,
        "block_size": plan.workload.block_size,
    }
    return header, arrays


def plan_to_bytes(plan: "Plan") -> bytes:
    """See :meth:`torch_dcp.plan.Plan.to_bytes`."""
    header, arrays = _content(plan)
    body, specs, offset = [], [], 0
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        raw = a.tobytes()
        specs.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
        pad = (-len(raw)) % 8
        body.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    doc = {"content": {**header, "arrays": specs}, "meta": {"plan_seconds": plan.plan_seconds}}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return FORMAT_MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(text)) + text + b"".join(body)


def plan_from_bytes(cls: type, data: bytes) -> "Plan":
    """See :meth:`torch_dcp.plan.Plan.from_bytes`."""
    data = bytes(data)
    if not data.startswith(FORMAT_MAGIC):
        raise PlanError("not a torch_dcp plan (bad magic)")
    n = len(FORMAT_MAGIC)
    try:
        version, hlen = struct.unpack_from("<IQ", data, n)
    except struct.error:
        raise PlanError("truncated plan header") from None
    if version != FORMAT_VERSION:
        raise PlanError(f"plan format version {version} is not supported (this build reads {FORMAT_VERSION})")
    start = n + struct.calcsize("<IQ")
    try:
        doc = json.loads(data[start:start + hlen])
        content = doc["content"]
        base = start + hlen
        arrays = {}
        for spec in content["arrays"]:
            dt = np.dtype(spec["dtype"])
            count = int(np.prod(spec["shape"])) if spec["shape"] else 1
            a = np.frombuffer(data, dtype=dt, count=count, offset=base + spec["offset"])
            arrays[spec["name"]] = a.reshape(spec["shape"]).astype(dt.newbyteorder("="))
        bd = content["batch"]
        for i, m in enumerate(bd["masks"]):
            if m.get("type") == "Ranges":
                bd["masks"][i] = {"type": "Ranges", "starts": arrays[f"mask{i}_starts"], "ends": arrays[f"mask{i}_ends"]}
        batch = BatchSpec.from_dict(bd)
        topology = Topology.from_dict(content["topology"])
        wl = Workload.from_arrays(batch, arrays, block_size=content["block_size"])
        if len(arrays["tile_rank"]) != wl.n_tiles:
            raise ValueError(f"{len(arrays['tile_rank'])} tile ranks for {wl.n_tiles} tiles")
        placement = Placement(wl, topology.world_size, arrays["block_rank"], arrays["tile_rank"],
                              planner=content["planner"])
        return cls(placement, topology, arrays["tile_division"], content["divisions"], doc["meta"]["plan_seconds"])
    except (KeyError, ValueError, TypeError, json.JSONDecodeError) as err:
        raise PlanError(f"corrupt plan payload: {err}") from None


def plan_digest(plan: "Plan") -> str:
    """See :meth:`torch_dcp.plan.Plan.digest`."""
    header, arrays = _content(plan)
    h = hashlib.sha256(FORMAT_MAGIC + struct.pack("<I", FORMAT_VERSION))
    h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode() + a.dtype.str.encode() + str(a.shape).encode())
        h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()
