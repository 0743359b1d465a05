"""A run checked against the same spec run step by step (the simulator's fast path off): what differs in their
records, request by request (`servewise simulate --verify`, `servewise cluster --verify`; servewise.fastpath is
what it checks)."""
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
    """Run `spec` again step by step (the fast path off) and compare it with `fast`, its run (a lab Record): a
    single engine's or a simulated cluster's (each instance's steps, cluster.sim)."""
    eng = build(spec.engine)
    cluster = hasattr(eng, "engines")
    for e in eng.engines if cluster else [eng]:
        e.runner.bulk = False
    ref = run(spec, engine=eng)
    diffs = differences(fast, ref)
    if cluster and fast.steps["per_instance"] != ref.steps["per_instance"]:
        diffs.insert(0, f"steps per instance: {fast.steps['per_instance']} != {ref.steps['per_instance']}")
    engines = fast.engine.engines if cluster else [fast.engine]
    return {"identical": not diffs, "differences": diffs[:20], "steps": ref.steps["steps"],
            "bulk_steps": sum(e.runner.bulk_steps for e in engines),
            "why_not": fast.engine.why_not_fast() if cluster else why_not(fast.engine),
            "fast_wall_s": fast.wall_s, "step_by_step_wall_s": ref.wall_s, "speedup": ref.wall_s / fast.wall_s}


def summary(v: dict) -> str:
    """verify's result in a few lines."""
    return (f"verify: {'identical to' if v['identical'] else 'DIFFERS from'} the step-by-step run ({v['steps']} steps, "
            f"{v['bulk_steps']} in bulk; {v['fast_wall_s']:.2f} s against {v['step_by_step_wall_s']:.2f} s, "
            f"{v['speedup']:.1f}x)" + "".join(f"\n  {d}" for d in v["differences"]))
