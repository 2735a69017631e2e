"""The cost model: how long a plan's instructions and transfers take on a device.

* :mod:`.model` -- :class:`CostModel` (kernel throughput tables, memory bandwidth, links, and
  the executor's own costs), the shipped presets (``a100``, ``h100``);
* :mod:`.executor` -- what torch_dcp's executor costs per division and per pass, by the work
  each kernel really performs (:class:`ExecutorCosts`);
* :mod:`.fit` -- fitting those costs to the executor's measured times;
* :mod:`.auto` -- ``cost_model="auto"``: the calibrated model of this device, else a preset.
"""

from .executor import KERNEL_WORK, ExecutorCosts, KernelCosts, KernelWork, LaunchCosts, MemoryCosts
from .model import A100, GPU_EXECUTOR, H100, CostModel, KernelTable, Links

__all__ = ["CostModel", "KernelTable", "Links", "A100", "H100", "GPU_EXECUTOR", "ExecutorCosts", "KernelCosts",
           "LaunchCosts", "MemoryCosts", "KernelWork", "KERNEL_WORK"]
