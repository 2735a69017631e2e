"""Benchmarks of torch_dcp, one command line (the library itself never imports this package)::

    python -m torch_dcp.benchmarks planners [--block-size 1024] ...    planners on the same 131,072-token batches
    python -m torch_dcp.benchmarks paper [--sweep block-size|sparsity|eps] ...
                                                                      the DCP paper's microbenchmark, simulated
    python -m torch_dcp.benchmarks compare [--clusters a100x4,h100x1] [--json] ...
                                                                      dcp vs every baseline at its best CP size, simulated
    python -m torch_dcp.benchmarks why [--clusters h100x4] [--cost kernels] ...
                                                                      where dcp's own plans lose time to all-gather CP
    python -m torch_dcp.benchmarks pictures --out docs ...            placement map, traffic, timeline (PNG)
    python -m torch_dcp.benchmarks kernels reduce|table|division|plan ...
                                                                      kernel micro-benchmarks
    python -m torch_dcp.benchmarks ops [--ranks 3 --divisions 2] ...  executor operations per division
    python -m torch_dcp.benchmarks step [--mask lambda --ranks 32] ...  a step's attention (fwd + bwd) vs dense calls
    python -m torch_dcp.benchmarks calibrate [--check] ...           this device's cost model, from the executor
    python -m torch_dcp.benchmarks loader [--workers 2] ...           steps/s the planning loader sustains (32 ranks)
    python -m torch_dcp.benchmarks scale [--cases 131k,1m,4m] ...      dcp's default plan at 32 to 1,024 ranks
    python -m torch_dcp.benchmarks main-job [--pairs 3] [-- ARGS]      the main job vs PyTorch's context_parallel, side by side
    python -m torch_dcp.benchmarks gpu-report --out DIR [--quick | --dry-run | --stages a,b]
                                                                      every GPU figure against its target, one command

Modules: :mod:`.common` (masks by name, batches, length sources, progress bar),
:mod:`.planners` (``planners``, ``paper``), :mod:`.sweeps` (``paper --sweep``),
:mod:`.compare` and :mod:`.static_cp` (``compare``: baselines at their best CP size), :mod:`.why` (``why``),
:mod:`.pictures` and :mod:`.viz` (``pictures``; matplotlib), :mod:`.kernels` (``kernels ...``),
:mod:`.ops` (``ops``), :mod:`.step` (``step``), :mod:`.calibrate` and :mod:`.measure` (``calibrate``), :mod:`.loader` (``loader``), :mod:`.scale` (``scale``),
:mod:`.main_job` (``main-job``), :mod:`.gpu_report` (``gpu-report``),
:mod:`.cli` (the argument parser). The progress bar needs tqdm and the pictures matplotlib:
``pip install 'torch-dcp[benchmarks]'``.
"""
