import random

import pytest
import torch

torch.set_num_threads(1)  # tests are correctness checks; one thread keeps them steady on a shared machine


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 30000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Built-in tiny models written as Hugging Face checkpoints (config.json + model.safetensors)."""
    from servewise.models.loader import save_hf_checkpoint

    return {name: save_hf_checkpoint(name, str(tmp_path_factory.mktemp(name))) for name in ("tiny-llama", "tiny-opt")}
