"""Stand-in for ``tensorflow.lite.python.schema_py_generated``.

litert-torch 0.10.0 (``litert_torch/generative/layers/lora.py``) imports this module although
tensorflow is not one of its dependencies. The same flatbuffer schema ships with ai-edge-litert.
"""

from ai_edge_litert.schema_py_generated import *  # noqa: F403
