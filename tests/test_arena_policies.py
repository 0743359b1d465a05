"""The arena's policies (VTC, skip-join MLFQ, EDF) on the scheduler core, and policies from outside the
package: a file, an installed entry point."""
import subprocess
import sys
import textwrap

import pytest

from servewise.assembly import make_scheduler
from servewise.config import SchedulerConfig
from servewise.engine.block_manager import BlockManager
from servewise.engine.request import Status
from servewise.policies import ORDERING_POLICIES, resolve
from servewise.policies.edf import EarliestDeadlineFirst
from servewise.policies.mlfq import SkipJoinMLFQ
from servewise.policies.vtc import VirtualTokenCounter

from test_scheduler import req, run_step


def client_req(i, n, t, client):
    r = req(i, n, t)
    r.client = client
    return r


def drain(s, now=0.0, steps=1000):
    """Step the scheduler to the end; the request ids in the order their first step scheduled them."""
    order = []
    while s.has_unfinished() and steps:
        out = s.schedule(now)
        order += [rid for rid in out.scheduled if rid not in order]
        run_step(s, out, now)
        now, steps = now + 0.01, steps - 1
    return order


def test_vtc_serves_the_client_with_the_least_service_first():
    """Client a sends six requests at once, b two a little later; one request runs at a time. FCFS serves
    all of a's first; VTC lets b in as soon as a's counter passes b's."""
    orders = {}
    for policy in ("fcfs", "vtc"):
        s = make_scheduler(SchedulerConfig(policy=policy, max_num_seqs=1), BlockManager(64, 0, 4, 0.0))
        for i in range(6):
            s.add(client_req(i, 4, 0.0, "a"))
        for i in (6, 7):
            s.add(client_req(i, 4, 0.001, "b"))
        for r in list(s.waiting):
            r.params.max_tokens = 3
        orders[policy] = drain(s)
    assert orders["fcfs"] == [str(i) for i in range(8)]
    assert orders["vtc"][:4] == ["0", "6", "1", "7"]  # alternating: equal weighted service per request


def test_vtc_counts_weighted_tokens_and_lifts_a_returning_client():
    vtc = VirtualTokenCounter(input_weight=1.0, output_weight=2.0)
    a, b = client_req(0, 10, 0.0, "a"), client_req(1, 4, 0.0, "b")
    for r in (a, b):
        vtc.key(r, 0.0)
    a.first_scheduled_time, a.output_token_ids = 0.1, [1, 2, 3]  # 10 prompt + 3 output tokens
    assert vtc.counters(1.0) == {"a": 10 + 2 * 3, "b": 0}
    b.first_scheduled_time = 0.1
    b.status = Status.FINISHED
    vtc.counters(2.0)  # b's finished request folds into its base
    assert vtc.live["b"] == {} and vtc.base["b"] == 4
    late = client_req(2, 4, 3.0, "b")  # b returns while a is backlogged at 16: lifted, no credit for idling
    assert vtc.key(late, 3.0)[0] == 16
    c = client_req(3, 4, 3.0, "c")  # a new client starts level with the least served backlogged client
    assert vtc.key(c, 3.0)[0] == 16


def test_mlfq_skip_join_and_demotion():
    q = SkipJoinMLFQ(quantum=4, levels=4, prompt_tokens_per_token=16, starve_s=5.0)
    assert [q.entry(n) for n in (16, 64, 65, 128, 10_000)] == [0, 0, 1, 1, 3]
    r = req(0, 16, 0.0)
    levels = []
    for k in range(30):
        levels.append(q.level(r))
        r.output_token_ids.append(1)
        r.token_times.append(0.01 * k)
    assert levels == [0] * 4 + [1] * 8 + [2] * 16 + [3] * 2  # quanta 4, 8, 16 tokens
    assert q.key(r, 0.3)[0] == 3 and q.key(r, 0.29 + 5.0)[0] == 0  # no token for 5 s: back to the top
    with pytest.raises(ValueError):
        SkipJoinMLFQ(quantum=0)


def test_mlfq_lets_a_new_short_request_preempt_a_long_running_one():
    """One batch row: a request that has run through two queues is preempted for a new one, which
    FCFS would keep waiting."""
    for policy, expect in (("mlfq", True), ("fcfs", False)):
        s = make_scheduler(SchedulerConfig(policy=policy, max_num_seqs=1), BlockManager(64, 0, 4, 0.0))
        old = req(0, 4, 0.0)
        s.add(old)
        for t in range(30):
            run_step(s, s.schedule(0.01 * t), 0.01 * t)
        s.add(req(1, 4, 0.5))
        out = s.schedule(0.5)
        assert (out.scheduled == ["1"] and [rid for rid, _ in out.preempted] == ["0"]) is expect


def test_edf_orders_by_each_requests_next_token_deadline():
    edf = EarliestDeadlineFirst()
    a, b, c = req(0, 4, 0.0), req(1, 4, 1.0), req(2, 4, 0.0)
    a.ttft_target, a.tpot_target = 2.0, 0.1
    b.ttft_target, b.tpot_target = 0.5, 0.1
    assert edf.deadline(a) == 2.0 and edf.deadline(b) == 1.5 and edf.deadline(c) == float("inf")
    a.output_token_ids = [1] * 5  # a is ahead: its next token is due at 2.5
    assert sorted([a, b, c], key=lambda r: edf.key(r, 0.0)) == [b, a, c]


def test_a_policy_from_a_file_runs_by_its_path(tmp_path):
    path = tmp_path / "newest_first.py"
    path.write_text(textwrap.dedent("""
        from servewise.policies.ordering import Ordering, register

        @register("newest-first-file")
        class NewestFirst(Ordering):
            static = True

            def key(self, req, now):
                return (-req.arrival_time, req.seq_no)
    """))
    assert resolve(str(path)) == "newest-first-file" == resolve(f"{path}:newest-first-file")
    s = make_scheduler(SchedulerConfig(policy=str(path), max_num_seqs=1), BlockManager(64, 0, 4, 0.0))
    for i in range(3):
        s.add(req(i, 4, float(i)))
        s.waiting[-1].params.max_tokens = 1
    assert drain(s, 5.0) == ["2", "1", "0"]
    with pytest.raises(ValueError, match="no such file"):
        resolve(str(tmp_path / "missing.py"))


def test_a_policy_from_an_installed_entry_point_runs_by_name(tmp_path):
    """A package installed beside servewise (a distribution on the path with an entry point of the group
    servewise.policies) adds a policy that the command line accepts by name, with no edit of servewise."""
    (tmp_path / "my_policies.py").write_text(textwrap.dedent("""
        from servewise.policies.ordering import Ordering, register

        @register("longest-prompt-first")
        class LongestPromptFirst(Ordering):
            static = True

            def key(self, req, now):
                return (-req.num_prompt_tokens, req.arrival_time, req.seq_no)
    """))
    dist = tmp_path / "my_policies-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-policies\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[servewise.policies]\nlongest-prompt-first = my_policies\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from servewise.cli import main; "
            "main(['simulate', '--model', 'tiny-llama', '--hardware', 'a100-80g', '--policy', "
            "'longest-prompt-first', '--num-requests', '4', '--input-len', '16', '--output-len', '4'])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "longest-prompt-first" not in ORDERING_POLICIES  # loaded in that process only
    with pytest.raises(ValueError, match="unknown ordering policy 'longest-prompt-first'"):
        resolve("longest-prompt-first")  # not installed here


def test_the_openai_user_field_is_the_requests_client():
    from servewise.builder import build_sim_engine
    from servewise.server.protocol import CompletionRequest

    params = CompletionRequest(model="m", prompt="hi", max_tokens=2, user="alice").sampling_params(None, 16)
    eng = build_sim_engine("tiny-llama", hardware="a100-80g", num_device_blocks=64, policy="vtc")
    assert eng.add_request([5, 6, 7], params).client == "alice"
    assert eng.add_request([5, 6, 7], CompletionRequest(model="m", prompt="x").sampling_params(2, 16)).client is None
