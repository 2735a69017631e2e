"""Placement: the common result type of every planner."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..workload import Workload

__all__ = ["Placement"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every token block lives and where every tile is computed.

    A block's home rank holds its Q, K, V, O (and LSE, dO, dQ, dK, dV) and the token-level
    layers of its tokens; a tile's rank computes it.

    Attributes:
        workload: the blocks and tiles placed.
        world_size: ranks of the DCP group.
        block_rank: int64 ``[n_blocks]``, home rank of every block.
        tile_rank: int64 ``[n_tiles]``, rank computing every tile.
        planner: name of the planner that produced it.
        tile_round: optional int64 ``[n_tiles]``: scheduling rounds that run one after
            another (Megatron's barriers); ``None`` for one round.
    """

    workload: Workload
    world_size: int
    block_rank: np.ndarray
    tile_rank: np.ndarray
    planner: str = "custom"
    tile_round: np.ndarray | None = None

    def __post_init__(self):
        w = self.workload
        br = np.ascontiguousarray(self.block_rank, dtype=np.int64)
        tr = np.ascontiguousarray(self.tile_rank, dtype=np.int64)
        if br.shape != (w.n_blocks,):
            raise ValueError(f"Placement.block_rank: expected shape ({w.n_blocks},), got {br.shape}")
        if tr.shape != (w.n_tiles,):
            raise ValueError(f"Placement.tile_rank: expected shape ({w.n_tiles},), got {tr.shape}")
        for name, a in (("block_rank", br), ("tile_rank", tr)):
            if a.size and (a.min() < 0 or a.max() >= self.world_size):
                raise ValueError(f"Placement.{name}: ranks must lie in [0, {self.world_size})")
        br.setflags(write=False)
        tr.setflags(write=False)
        object.__setattr__(self, "block_rank", br)
        object.__setattr__(self, "tile_rank", tr)
        if self.tile_round is not None:
            rd = np.ascontiguousarray(self.tile_round, dtype=np.int64)
            if rd.shape != (w.n_tiles,) or (rd.size and rd.min() < 0):
                raise ValueError(f"Placement.tile_round: expected non-negative shape ({w.n_tiles},), got {rd.shape}")
            rd.setflags(write=False)
            object.__setattr__(self, "tile_round", rd)

    def rank_flops(self, backward: bool = False) -> np.ndarray:
        """Attention FLOPs per rank, float64 ``[world_size]``."""
        f = self.workload.tile_flops_bwd if backward else self.workload.tile_flops_fwd
        return np.bincount(self.tile_rank, weights=f, minlength=self.world_size)

    def rank_tokens(self) -> np.ndarray:
        """Resident tokens per rank, int64 ``[world_size]``."""
        return np.bincount(self.block_rank, weights=self.workload.block_len, minlength=self.world_size).astype(np.int64)
