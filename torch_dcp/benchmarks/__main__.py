"""``python -m torch_dcp.benchmarks COMMAND ...``: see :mod:`torch_dcp.benchmarks`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
