"""Integrations of torch_dcp into training frameworks.

Each submodule imports its framework (an optional dependency); importing ``torch_dcp`` or this
package imports none of them:

* :mod:`torch_dcp.integrations.torchtitan` -- a torchtitan config registry module
  (``pip install 'torch-dcp[torchtitan]'``).
* :mod:`torch_dcp.integrations.hf` -- Hugging Face transformers: the ``"torch_dcp"`` attention
  backend and a packing helper (``pip install 'torch-dcp[hf]'``).
"""
