"""servewise: an LLM-serving engine and scheduling laboratory."""
from servewise.llm import LLM, RequestOutput
from servewise.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
