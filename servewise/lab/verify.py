"""A run checked against the same spec run step by step (the simulator's fast path off): what differs in their
records, request by request (`servewise simulate --verify`; servewise.fastpath is what it checks)."""
from __future__ import annotations

from servewise.fastpath import why_not
from servewise.lab.run import build, run


def _same(x, y, rel: float) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= rel * max(1.0, abs(x), abs(y))
    return x == y


STEP_FIELDS = ("steps", "prefill_steps", "decode_steps", "prefill_requests", "computed_tokens", "busy_s")
REQUEST_FIELDS = ("request_id", "arrival", "prompt_tokens", "output_tokens", "first_scheduled", "first_token",
                  "finish", "finish_reason", "preemptions")


def differences(a, b, rel: float = 1e-9) -> list[str]:
    """What differs between two runs' records (lab.Record) of one spec: step counts, rejections, and every
    request's times (to `rel`), tokens, finish reason and preemptions."""
    out = [f"{k}: {a.steps.get(k)} != {b.steps.get(k)}" for k in STEP_FIELDS
           if not _same(a.steps.get(k), b.steps.get(k), rel)]
    if a.rejected != b.rejected:
        out.append(f"rejected: {len(a.rejected)} != {len(b.rejected)}")
    if a.swap != b.swap:
        out.append(f"swap: {a.swap} != {b.swap}")
    if len(a.requests) != len(b.requests):
        out.append(f"requests: {len(a.requests)} != {len(b.requests)}")
    for ra, rb in zip(a.requests, b.requests):
        out += [f"request {ra.request_id}: {f} {getattr(ra, f)} != {getattr(rb, f)}" for f in REQUEST_FIELDS
                if not _same(getattr(ra, f), getattr(rb, f), rel)]
        x, y = ra.token_times, rb.token_times
        if x != y and (len(x) != len(y) or not all(_same(p, q, rel) for p, q in zip(x, y))):
            out.append(f"request {ra.request_id}: token times differ")
    return out


def verify(spec, fast) -> dict:
    """Run `spec` again step by step (the fast path off) and compare it with `fast`, its run (a lab Record)."""
    eng = build(spec.engine)
    eng.runner.bulk = False
    ref = run(spec, engine=eng)
    diffs = differences(fast, ref)
    return {"identical": not diffs, "differences": diffs[:20], "steps": ref.steps["steps"],
            "bulk_steps": fast.engine.runner.bulk_steps, "why_not": why_not(fast.engine),
            "fast_wall_s": fast.wall_s, "step_by_step_wall_s": ref.wall_s, "speedup": ref.wall_s / fast.wall_s}
