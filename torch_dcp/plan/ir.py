"""The plan IR: the five instructions of a rank's program (DCP paper §5) and the one table that
maps each instruction to its handler.

A program is a list of :class:`BlockwiseCopy`, :class:`CommLaunch`, :class:`CommWait`,
:class:`BlockwiseAttention` and :class:`BlockwiseReduction`. Buffers and transfer kinds are
:class:`~torch_dcp.workload.Buf` members; rows are tokens.

Everything that interprets programs -- the executor (through its device plan), the simulator and
the validator -- goes through :data:`HANDLERS` / :func:`dispatch`: a consumer defines one method
per instruction (``on_copy``, ``on_launch``, ``on_wait``, ``on_attention``, ``on_reduction``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

import numpy as np

from ..workload import Buf

__all__ = [
    "PlanError",
    "ReduceOp",
    "Transfer",
    "BlockwiseCopy",
    "CommLaunch",
    "CommWait",
    "BlockwiseAttention",
    "BlockwiseReduction",
    "Instruction",
    "Program",
    "HANDLERS",
    "dispatch",
]


class PlanError(ValueError):
    """A plan is inconsistent (raised by :meth:`Plan.validate` and deserialisation)."""


class ReduceOp(enum.Enum):
    """How a :class:`BlockwiseReduction` combines partials: the LSE merge of partial outputs
    (``o = sum_i exp(lse_i - lse) o_i``, ``lse = log sum_i exp(lse_i)``) or a plain sum."""

    LSE_MERGE = "lse_merge"
    SUM = "sum"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Blocks of one kind moving between this rank and ``peer``.

    ``rows[i]`` is the first row of ``blocks[i]`` in this rank's buffer ``kind`` (the source of a
    send, the destination of a receive). Message order is ``blocks`` order. ``tokens``: the
    blocks' tokens together (the message's rows).
    """

    peer: int
    kind: Buf
    blocks: np.ndarray
    rows: np.ndarray
    tokens: int


@dataclasses.dataclass(frozen=True)
class BlockwiseCopy:
    """Copy local blocks of ``kind`` (``Buf.Q`` or ``Buf.KV``) from the rank's inputs into its
    work buffer: rows ``src_rows[i]`` of the input to ``dst_rows[i]`` of the buffer."""

    handler: ClassVar[str] = "on_copy"
    kind: Buf
    blocks: np.ndarray
    src_rows: np.ndarray
    dst_rows: np.ndarray


@dataclasses.dataclass(frozen=True)
class CommLaunch:
    """Start the sends and receives of ``phase`` (asynchronous)."""

    handler: ClassVar[str] = "on_launch"
    phase: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class CommWait:
    """Wait until the receives (and sends) of ``phase`` are complete."""

    handler: ClassVar[str] = "on_wait"
    phase: int


@dataclasses.dataclass(frozen=True)
class BlockwiseAttention:
    """Attention over the tiles of one division, in groups sharing a query block.

    Group ``g``: query block ``q_block[g]`` at ``Buf.Q`` row ``q_row[g]``, key/value blocks
    ``kv_block[kv_ptr[g]:kv_ptr[g+1]]`` at ``Buf.KV`` rows ``kv_row[...]`` (tiles ``tile[...]``).
    Forward writes the group's partial output and LSE to ``Buf.OPART`` row ``out_row[g]``;
    backward adds dQ to ``Buf.DQ`` row ``out_row[g]`` and dK, dV to ``Buf.DKV`` rows ``kv_row``.
    """

    handler: ClassVar[str] = "on_attention"
    division: int
    q_block: np.ndarray
    q_row: np.ndarray
    out_row: np.ndarray
    kv_ptr: np.ndarray
    kv_block: np.ndarray
    kv_row: np.ndarray
    tile: np.ndarray


@dataclasses.dataclass(frozen=True)
class BlockwiseReduction:
    """Reduce rows of buffer ``src`` into buffer ``dst``: destination ``i`` (block
    ``dst_block[i]`` at row ``dst_row[i]``) receives the ``op`` of the ``src`` slots at rows
    ``src_row[src_ptr[i]:src_ptr[i+1]]``. An empty source list gives zeros (LSE ``-inf``)."""

    handler: ClassVar[str] = "on_reduction"
    op: ReduceOp
    src: Buf
    dst: Buf
    dst_block: np.ndarray
    dst_row: np.ndarray
    src_ptr: np.ndarray
    src_row: np.ndarray


Instruction = BlockwiseCopy | CommLaunch | CommWait | BlockwiseAttention | BlockwiseReduction

#: The one instruction table: instruction type -> the name of its handler method.
HANDLERS: dict[type, str] = {cls: cls.handler for cls in (BlockwiseCopy, CommLaunch, CommWait, BlockwiseAttention,
                                                          BlockwiseReduction)}


def dispatch(consumer: Any, ins: Instruction, *args: Any) -> Any:
    """Call ``consumer``'s handler of ``ins`` (from :data:`HANDLERS`) with ``ins`` and ``args``.

    Raises:
        PlanError: ``ins`` is not one of the five instructions.
    """
    name = HANDLERS.get(type(ins))
    if name is None:
        raise PlanError(f"unknown instruction {ins!r}")
    return getattr(consumer, name)(ins, *args)


@dataclasses.dataclass(frozen=True)
class Program:
    """One rank's forward or backward program.

    Attributes:
        rank, backward: whose program and which pass.
        instructions: the program, in order.
        local_rows: tokens held by the rank.
        buffer_rows: rows of every work buffer (``Buf.Q``, ``Buf.KV``, and ``Buf.OPART`` forward or
            ``Buf.DQ``, ``Buf.DKV`` backward).
    """

    rank: int
    backward: bool
    instructions: tuple[Instruction, ...]
    local_rows: int
    buffer_rows: dict[Buf, int]

    @property
    def divisions(self) -> list[int]:
        """Divisions that run attention on this rank, in program order."""
        return [int(i.division) for i in self.instructions if isinstance(i, BlockwiseAttention)]

    def describe(self) -> str:
        """Human-readable listing."""
        rows = {b.name: n for b, n in self.buffer_rows.items()}
        lines = [f"rank {self.rank} {'backward' if self.backward else 'forward'}: {rows}"]
        lines.extend("  " + dispatch(_Describe, ins) for ins in self.instructions)
        return "\n".join(lines)


class _Describe:
    """One line per instruction (a consumer of the table like any other)."""

    @staticmethod
    def on_copy(ins: BlockwiseCopy) -> str:
        return f"BlockwiseCopy({ins.kind.name}, {len(ins.blocks)} blocks)"

    @staticmethod
    def on_launch(ins: CommLaunch) -> str:
        s = ", ".join(f"{t.kind.name}{t.blocks.tolist()}->{t.peer}" for t in ins.sends)
        r = ", ".join(f"{t.kind.name}{t.blocks.tolist()}<-{t.peer}" for t in ins.recvs)
        return f"CommLaunch(phase={ins.phase}; send {s}; recv {r})"

    @staticmethod
    def on_wait(ins: CommWait) -> str:
        return f"CommWait(phase={ins.phase})"

    @staticmethod
    def on_attention(ins: BlockwiseAttention) -> str:
        return f"BlockwiseAttention(division={ins.division}, groups={len(ins.q_block)}, tiles={len(ins.tile)})"

    @staticmethod
    def on_reduction(ins: BlockwiseReduction) -> str:
        return f"BlockwiseReduction({ins.op.value}, {ins.src.name}->{ins.dst.name}, {len(ins.dst_row)} slots)"
