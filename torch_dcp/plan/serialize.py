"""Plan serialisation (no pickle) and the content digest.

Format (version 5): magic, then ``<IQQ`` (format version, header bytes, body bytes), the SHA-256
of everything after the magic but the checksum itself (version, lengths, header, body), a JSON
header (batch, topology, planner, routing, divisions, block size and the array table), then raw
little-endian arrays -- block spans, block and tile ranks, tile divisions in the narrowest
integer types, and ring groups (Megatron's CP groups) where the placement has them. Tiles and
programs are recomputed on load. Any changed, missing or extra byte
fails the length or checksum test: a corrupted plan is never loaded as another plan.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from ..batch import BatchSpec
from ..masks import Ranges
from ..planners.base import Placement, Routing, Runtime
from ..topology import Topology
from ..workload import Workload, smallest_int
from .ir import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

__all__ = ["FORMAT_MAGIC", "FORMAT_VERSION", "plan_to_bytes", "plan_from_bytes", "plan_digest"]

FORMAT_MAGIC = b"TDCPLAN\0"
FORMAT_VERSION = 5
_LENGTHS = struct.Struct("<IQQ")
_SUM = 32  # SHA-256 bytes


def _content(plan: "Plan") -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    arrays = dict(plan.workload.arrays())
    arrays["block_rank"] = plan.placement.block_rank.astype(smallest_int(plan.world_size))
    arrays["tile_rank"] = plan.placement.tile_rank.astype(smallest_int(plan.world_size))
    arrays["tile_division"] = plan.tile_division.astype(smallest_int(plan.divisions))
    if plan.placement.ring_groups is not None:  # Megatron's rings: the routes depend on them
        arrays["ring_groups"] = plan.placement.ring_groups
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
        "routing": plan.placement.routing.value,
        "divisions": plan.divisions,
        "block_size": plan.workload.block_size,
    }
    if plan.placement.runtime is not Runtime.EXECUTOR:  # a baseline's own implementation runs it
        header["runtime"] = plan.placement.runtime.value
    if plan.placement.cp_size is not None:  # static CP groups smaller than the world
        header["cp_size"] = plan.placement.cp_size
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
    doc = {"content": {**header, "arrays": specs}, "meta": {"plan_seconds": plan.plan_seconds,
                                                           "candidates": [list(c) for c in plan.candidates],
                                                           "cost_model": plan.cost_model}}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    payload = text + b"".join(body)
    lengths = _LENGTHS.pack(FORMAT_VERSION, len(text), len(payload) - len(text))
    return FORMAT_MAGIC + lengths + hashlib.sha256(lengths + payload).digest() + payload


def plan_from_bytes(cls: type, data: bytes) -> "Plan":
    """See :meth:`torch_dcp.plan.Plan.from_bytes`."""
    try:
        data = bytes(data)
    except TypeError:
        raise PlanError(f"a plan is bytes, got {type(data).__name__}") from None
    if not data.startswith(FORMAT_MAGIC):
        raise PlanError("not a torch_dcp plan (bad magic)")
    n = len(FORMAT_MAGIC)
    if len(data) < n + _LENGTHS.size + _SUM:
        raise PlanError(f"truncated plan: {len(data)} bytes, shorter than its header")
    version, hlen, blen = _LENGTHS.unpack_from(data, n)
    if version != FORMAT_VERSION:
        raise PlanError(f"plan format version {version} is not supported (this build reads {FORMAT_VERSION})")
    start = n + _LENGTHS.size + _SUM
    if len(data) != start + hlen + blen:
        raise PlanError(f"plan of {len(data)} bytes, its header announces {start + hlen + blen} (truncated or extended)")
    lengths, payload = data[n:n + _LENGTHS.size], data[start:]
    if hashlib.sha256(lengths + payload).digest() != data[n + _LENGTHS.size:start]:
        raise PlanError("plan checksum mismatch: the bytes were changed after serialisation")
    try:  # the checksum holds: a failure here is a plan this build cannot read
        doc = json.loads(payload[:hlen])
        content = doc["content"]
        arrays = {}
        for spec in content["arrays"]:
            dt = np.dtype(spec["dtype"])
            count = int(np.prod(spec["shape"])) if spec["shape"] else 1
            a = np.frombuffer(payload, dtype=dt, count=count, offset=hlen + spec["offset"])
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
                              planner=content["planner"], routing=Routing(content["routing"]),
                              ring_groups=arrays.get("ring_groups"),
                              runtime=Runtime(content.get("runtime", Runtime.EXECUTOR.value)),
                              cp_size=content.get("cp_size"))
        plan = cls(placement, topology, arrays["tile_division"], content["divisions"], doc["meta"]["plan_seconds"])
        plan.candidates = [(str(label), float(t)) for label, t in doc["meta"].get("candidates", [])]
        plan.cost_model = str(doc["meta"].get("cost_model", ""))
        return plan
    except Exception as err:  # noqa: BLE001 - one error type for every unreadable payload
        raise PlanError(f"unreadable plan payload: {type(err).__name__}: {err}") from None


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
