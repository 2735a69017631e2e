"""DCP beside tensor parallelism: how a TP degree splits a batch's attention heads.

Tensor parallelism (Megatron-LM, Shoeybi et al., arXiv 1909.08053, §3) shards an attention
layer by heads: TP rank ``t`` of ``TP`` computes query heads ``[t·H/TP, (t+1)·H/TP)`` and the
key/value heads those query heads read. With GQA and ``H_kv ≥ TP`` the KV heads are sharded
alike (``H_kv/TP`` per rank); with ``H_kv < TP`` each KV head is replicated on ``TP/H_kv``
consecutive TP ranks (Megatron-LM's and vLLM's rule), so every rank holds one KV head.

The DCP paper runs its end-to-end results this way (Jiang et al., arXiv 2510.10620, §6.2,
§7.2): TP inside a node, DCP over the data-parallel dimension(s), one plan per step shared by
the TP ranks of a DCP rank with the head count scaled. A plan depends on the heads only
through the bytes and FLOPs per token, so the TP ranks run one plan made for the TP-local
heads (:meth:`TensorParallelHeads.local_batch`), each over its own DCP sub-group (the ranks of
the same TP index), and the attention of TP rank ``t`` is exactly the dense attention of its
heads: the head split is exact.

The planners never see TP: the plan is made for the local :class:`~torch_dcp.BatchSpec` and the
DCP group's :class:`~torch_dcp.Topology` (:meth:`Topology.from_mesh` of the DCP dimension(s)).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .batch import BatchSpec

__all__ = ["TensorParallelHeads"]


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"TensorParallelHeads.{name} must be a positive integer, got {v!r}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class TensorParallelHeads:
    """The heads of one attention layer split over ``degree`` tensor-parallel ranks.

    Attributes:
        n_heads: the layer's query heads ``H``.
        n_kv_heads: its key/value heads ``H_kv`` (GQA; ``H % H_kv == 0``).
        degree: the tensor-parallel degree ``TP``.

    Raises:
        ValueError: a count that is not a positive integer; ``H_kv`` not dividing ``H``; ``TP``
            not dividing ``H``; ``H_kv ≥ TP`` with ``TP`` not dividing ``H_kv``, or
            ``H_kv < TP`` with ``H_kv`` not dividing ``TP`` (the heads would not split evenly, or
            a rank's query heads would read two KV heads it does not hold).
    """

    n_heads: int
    n_kv_heads: int
    degree: int

    def __post_init__(self):
        h, hkv, tp = (_positive(n, getattr(self, n)) for n in ("n_heads", "n_kv_heads", "degree"))
        if h % hkv:
            raise ValueError(f"TensorParallelHeads: n_kv_heads={hkv} must divide n_heads={h} (GQA groups)")
        if h % tp:
            raise ValueError(f"TensorParallelHeads: the tensor-parallel degree {tp} must divide the {h} query heads")
        if hkv >= tp and hkv % tp:
            raise ValueError(f"TensorParallelHeads: the tensor-parallel degree {tp} must divide the {hkv} key/value "
                             "heads (or be a multiple of them, which replicates each key/value head)")
        if hkv < tp and tp % hkv:
            raise ValueError(f"TensorParallelHeads: {hkv} key/value heads must divide the tensor-parallel degree {tp} "
                             "(each key/value head is replicated on degree / n_kv_heads ranks)")

    @classmethod
    def of(cls, batch: BatchSpec, degree: int) -> "TensorParallelHeads":
        """The split of ``batch``'s global heads over ``degree`` ranks (raises as the class)."""
        return cls(batch.n_heads, batch.n_kv_heads, degree)

    @property
    def local_heads(self) -> int:
        """Query heads per TP rank, ``H / TP``."""
        return self.n_heads // self.degree

    @property
    def local_kv_heads(self) -> int:
        """Key/value heads per TP rank: ``H_kv / TP``, or 1 (replicated) when ``H_kv < TP``."""
        return max(1, self.n_kv_heads // self.degree)

    def _index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < self.degree:
            raise ValueError(f"TensorParallelHeads: TP index must be an integer in [0, {self.degree}), got {index!r}")
        return int(index)

    def query_heads(self, index: int) -> range:
        """The global query heads of TP rank ``index`` (consecutive).

        Raises:
            ValueError: ``index`` outside ``[0, degree)``.
        """
        i = self._index(index)
        return range(i * self.local_heads, (i + 1) * self.local_heads)

    def kv_heads(self, index: int) -> range:
        """The global key/value heads TP rank ``index`` holds (its query heads' GQA groups).

        Raises:
            ValueError: ``index`` outside ``[0, degree)``.
        """
        i = self._index(index)
        first = i * self.local_heads // (self.n_heads // self.n_kv_heads)
        return range(first, first + self.local_kv_heads)

    def local_batch(self, batch: BatchSpec) -> BatchSpec:
        """``batch`` with the TP-local head counts: the BatchSpec every TP rank plans and runs
        (documents, masks, head_dim and dtype unchanged).

        Raises:
            ValueError: ``batch``'s heads are not this split's.
        """
        if (batch.n_heads, batch.n_kv_heads) != (self.n_heads, self.n_kv_heads):
            raise ValueError(f"TensorParallelHeads.local_batch: the batch has {batch.n_heads}/{batch.n_kv_heads} "
                             f"heads, this split is of {self.n_heads}/{self.n_kv_heads}")
        d = batch.to_dict()
        d.update(n_heads=self.local_heads, n_kv_heads=self.local_kv_heads)
        return BatchSpec.from_dict(d)
