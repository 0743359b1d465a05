"""servewise: an LLM-serving engine and scheduling laboratory."""
import os

# oneDNN builds a kernel per (linear layer, row count) and keeps 1,024 of them by default: prompts of
# varied lengths then never stop paying for new ones (measured: prefills of every length 1-256 on
# tiny-llama ran 35% slower per token than the same lengths once cached). Their memory is small.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")

from servewise.llm import LLM, RequestOutput  # noqa: E402
from servewise.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
