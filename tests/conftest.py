import os
import random
import time

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)  # tests are correctness checks; one thread keeps them steady on a shared machine

# Property-based tests draw the same examples on every run ("ci", the default): a run cannot fail on an
# example the previous one never drew, and no example is timed (no deadline). HYPOTHESIS_PROFILE=explore
# draws fresh examples each run, to look for new failures on purpose.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def poisson_workload(n: int, seed: int, rate: float, prompt: tuple[int, int], output: tuple[int, int]):
    """(items, arrival times): n requests of prompt and output lengths drawn uniformly from the ranges, arriving
    as a Poisson process of `rate` requests a second."""
    from servewise.workloads.datasets import WorkloadRequest

    rng = random.Random(seed)
    items = [WorkloadRequest(rng.randint(*prompt), rng.randint(*output)) for _ in range(n)]
    t, arrivals = 0.0, []
    for _ in items:
        t += rng.expovariate(rate)
        arrivals.append(t)
    return items, arrivals


def random_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 30000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Built-in tiny models written as Hugging Face checkpoints (config.json + model.safetensors)."""
    from servewise.models.loader import save_hf_checkpoint

    return {name: save_hf_checkpoint(name, str(tmp_path_factory.mktemp(name))) for name in ("tiny-llama", "tiny-opt")}


# The shared workload data sits beside the repository; the package never looks for it itself.
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.pardir, "shared", "data")


@pytest.fixture(scope="session")
def data_dir():
    if not os.path.isfile(os.path.join(DATA_DIR, "AzureLLMInferenceTrace_conv.csv.gz")):
        pytest.skip("the shared workload data is not beside the repository")
    return os.path.normpath(DATA_DIR)


def wait_until(cond, timeout: float = 60.0, what: str = "the condition") -> None:
    """Wait for cond() to hold, polling. The timeout only guards against a hang: it fails the test, and
    is never what a test measures."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.01)


def start_server(args: list[str], timeout: float = 180.0, tries: int = 3, **popen):
    """`servewise serve ARGS --port P` on a port free a moment ago, up and healthy: (process, port). A port is
    only known free until the server binds it, and other tests' processes (Ray's nodes) bind ports too; a
    server that finds its port taken exits, and is started again on another."""
    import socket
    import subprocess
    import sys

    from servewise.bench.peer import wait_healthy

    for attempt in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "servewise", "serve", *args, "--port", str(port)], **popen)
        try:
            wait_healthy(port, proc, timeout=timeout)
            return proc, port
        except RuntimeError:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if attempt == tries - 1:
                raise


def refused(argv: list[str], capsys) -> str:
    """Run a command that must refuse its input: exit status 2, no traceback, exactly one `error:` line and
    that one last (argparse's usage lines, or what the command printed before it, aside); returns it."""
    from servewise.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert lines == [err.strip().splitlines()[-1]], err
    return lines[0]
