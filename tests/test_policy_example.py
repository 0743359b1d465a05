"""The guide's example policy (policies/least_served.py, docs/architecture.md "Write a policy"): one file,
registered by name, on the scheduler, the simulator and the real engine with no change elsewhere."""
import subprocess
import sys

from servewise import LLM, SamplingParams
from servewise.assembly import make_scheduler
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.policies import ADMISSION_RULES, ORDERING_POLICIES

from decisions import fingerprint
from test_scheduler import req, run_step


def test_it_is_registered_by_its_file_alone():
    assert ORDERING_POLICIES["las"].__module__ == "servewise.policies.least_served"
    assert ADMISSION_RULES["las"] == "swapped-first"
    shown = subprocess.run([sys.executable, "-m", "servewise", "simulate", "--policy", "las", "--help"],
                           capture_output=True, text=True)
    assert shown.returncode == 0 and "registered: fcfs, " in shown.stdout and "las" in shown.stdout.split("registered:")[1]


def test_the_most_served_request_is_preempted_first():
    """Two running requests, the earlier one having produced more tokens; when blocks run out, least
    attained service preempts the earlier one, first come first served the later one."""
    victims = {}
    for policy in ("las", "fcfs"):
        bm = BlockManager(4, 0, block_size=4, watermark=0.0)
        s = make_scheduler(SchedulerConfig(policy=policy), bm)
        old, new = req(0, 4, 0.0), req(1, 3, 1.0)
        s.add(old)
        for _ in range(3):  # old prefills and decodes: 3 tokens out, 7 in all, 2 blocks
            run_step(s, s.schedule(0.5))
        s.add(new)  # 3 tokens, 1 block: one block stays free
        out = s.schedule(1.0)
        while not out.preempted:  # both decode until both need a block and none is free
            assert len(old.output_token_ids) > len(new.output_token_ids) and len(out.scheduled) <= 2
            run_step(s, out, 1.0)
            out = s.schedule(1.5)
        victims[policy] = [rid for rid, _ in out.preempted]
    assert victims == {"las": ["0"], "fcfs": ["1"]}


def test_it_runs_in_the_simulator_and_decides_otherwise_than_fcfs():
    las, fcfs = fingerprint(policy="las"), fingerprint(policy="fcfs")
    assert las["digest"] != fcfs["digest"]
    assert las["preemptions"]["recompute"] > 0 and las["end_s"] > 0


def test_it_runs_on_the_real_engine_with_the_same_tokens():
    prompts = [[5 + i] * (6 + 5 * i) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = LLM("tiny-llama", num_device_blocks=512).generate(prompts, params)
    llm = LLM("tiny-llama", num_device_blocks=10, num_host_blocks=0, policy="las", block_size=8)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.engine.stats().preemptions["recompute"] > 0  # the pool was small enough for the policy to choose
