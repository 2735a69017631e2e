"""The ``--dcp.*`` keys of torchtitan's DCP trainer (:mod:`torch_dcp.integrations.torchtitan`):
:class:`DCPConfig`, with what the planner and the executor take from it and its checks (no
torchtitan import)."""

from __future__ import annotations

from dataclasses import dataclass

from torch_dcp.cost import CostModel
from torch_dcp.executor.kernels import KERNEL_NAMES
from torch_dcp.planners import PLANNERS

__all__ = ["DCPConfig", "KERNELS"]

KERNELS = KERNEL_NAMES


@dataclass(kw_only=True, slots=True)
class DCPConfig:
    """The ``--dcp.*`` keys."""

    planner: str = "dcp"
    """Placement of token blocks and attention tiles: dcp (hypergraph), greedy, fcp, megatron, ring or allgather."""

    block_size: int = 1024
    """Tokens per block (ignored by ring, whose chunks are 1/(2W) of each document)."""

    divisions: str = "default"
    """Divisions per rank, to overlap communication with compute: a positive integer, or default
    (torch_dcp.plan's: 4, where dcp's time objective may keep its plan's intra-node tiles first at 6)."""

    objective: str = "time"
    """dcp only: time (candidates timed on the simulator, compute balance may loosen to 2x where links are the
    bottleneck) or bytes (compute within 1.1 of the mean, fewest bytes moved)."""

    head_parallel: str = "default"
    """Ranks of a head group trading heads by all-to-all before the plan runs over the groups (DeepSpeed-Ulysses
    inside a node): a positive integer dividing the heads and the ranks per node, auto (dcp only: it keeps the
    fastest N on the simulator) or default (auto for dcp's time objective, else 1)."""

    cost_model: str = "auto"
    """dcp's cost model: auto (this device's calibration, else a shipped preset), a100, h100 or a JSON file."""

    kernel: str = "auto"
    """Attention kernel of the executor: auto, flex, varlen, flash_attn, sdpa or reference."""

    check_plan: bool = False
    """Validate every plan (every tile once, inputs present, sends matched) before running it."""

    timeout: float = 600.0
    """Seconds any wait of the DCP step may block (the plan check, every transfer, a plan made ahead)."""

    plan_ahead: int = 2
    """Microbatches planned ahead by planning worker processes, spread over the ranks and shared through the
    process group's store (torch_dcp.data.PlanningLoader); 0 plans every microbatch in line on every rank."""

    plan_workers: int = 1
    """Planning worker processes per rank (with plan_ahead > 0)."""

    replay: bool = True
    """Layer replay on CUDA: the first layer of a step records the rank's attention device work (a CUDA graph) and
    every other layer replays it; --dcp.no-replay runs every layer eagerly. No effect on CPU."""

    token_capacity: float = 1.25
    """Pipeline parallelism only: every rank's tokens of a microbatch are padded to this many times the mean
    (microbatch rows x seq_len), the fixed shape pipeline stages exchange; a plan that puts more on a rank stops
    the step naming this key."""

    def division_count(self) -> int | None:
        """``divisions`` as :func:`torch_dcp.plan` takes it: an integer, or None for its default."""
        return None if str(self.divisions) == "default" else int(self.divisions)

    def planner_options(self) -> dict:
        """Options of the planner beyond block size and divisions (dcp's objective, the head parallelism)."""
        out: dict = {"objective": self.objective, "cost_model": self.cost_model} if self.planner == "dcp" else {}
        hp = str(self.head_parallel)
        if hp != "default":
            out["head_parallel"] = hp if hp == "auto" else int(hp)
        return out

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad key."""
        if self.planner not in PLANNERS:
            raise ValueError(f"--dcp.planner: unknown planner {self.planner!r}; choose one of {sorted(PLANNERS)}")
        for key, value in (("block-size", self.block_size), ("plan-workers", self.plan_workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"--dcp.{key} must be a positive integer, got {value!r}")
        div = str(self.divisions)
        if isinstance(self.divisions, bool) or not (div == "default" or (div.isdigit() and int(div) > 0)):
            raise ValueError(f"--dcp.divisions must be default or a positive integer, got {self.divisions!r}")
        if isinstance(self.plan_ahead, bool) or not isinstance(self.plan_ahead, int) or self.plan_ahead < 0:
            raise ValueError(f"--dcp.plan-ahead must be an integer >= 0, got {self.plan_ahead!r}")
        if self.objective not in ("time", "bytes"):
            raise ValueError(f"--dcp.objective must be time or bytes, got {self.objective!r}")
        hp = str(self.head_parallel)
        if hp not in ("auto", "default") and not (hp.isdigit() and int(hp) > 0):
            raise ValueError(f"--dcp.head-parallel must be default, auto or a positive integer, got "
                             f"{self.head_parallel!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"--dcp.kernel: unknown kernel {self.kernel!r}; choose one of {list(KERNELS)}")
        if isinstance(self.token_capacity, bool) or not self.token_capacity >= 1.0:
            raise ValueError(f"--dcp.token-capacity must be a number >= 1, got {self.token_capacity!r}")
        if not self.timeout > 0:
            raise ValueError(f"--dcp.timeout must be a positive number of seconds, got {self.timeout!r}")
        try:
            CostModel.load(self.cost_model)
        except ValueError as err:
            raise ValueError(f"--dcp.cost-model: {err}") from None
