"""`servewise bench chaos`."""
from __future__ import annotations

from servewise.commands.options import at_least, float_at_least

HELP = ("a served cluster under load while instances are killed, KV hand-offs dropped, stalled or corrupted, "
        "KV store entries damaged and its server stopped")


def arguments(p) -> None:
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--instances", default="prompt=1,token=1", help="the cluster (as `serve --instances`)")
    p.add_argument("--num-requests", type=at_least(1), default=200)
    p.add_argument("--rate", type=float_at_least(0, strict=True), default=4.0, help="requests/s (Poisson)")
    p.add_argument("--input-len", type=at_least(1), default=64)
    p.add_argument("--output-len", type=at_least(1), default=32)
    p.add_argument("--kills", type=at_least(0), default=4, help="instances killed (SIGKILL) at seeded moments")
    for name, default, what in (("drop", 0.1, "whose KV never arrives"), ("stall", 0.05, "whose first layer only "
                                "arrives"), ("corrupt", 0.05, "with a bit flipped on the way")):
        p.add_argument(f"--{name}", type=float_at_least(0), default=default, help=f"share of hand-offs {what}")
    p.add_argument("--prefixes", type=at_least(0), default=16,
                   help="shared prompt prefixes, in turn; the instances then keep named blocks in a KV store served "
                        "over TCP (0: every prompt its own, no store)")
    p.add_argument("--prefix-len", type=at_least(1), default=32, help="tokens of each shared prefix")
    p.add_argument("--store-corrupt", type=float_at_least(0), default=0.1,
                   help="share of the store's entries damaged (a byte changed) after they are written")
    p.add_argument("--store-outages", type=at_least(0), default=1,
                   help="times the store's server is stopped at seeded moments")
    p.add_argument("--outage", dest="outage_s", type=float_at_least(0, strict=True), default=3.0,
                   help="seconds each store outage lasts")
    p.add_argument("--device-blocks", type=at_least(8), default=48,
                   help="each instance's KV pool when there is a store (small, so cached prefixes are evicted and "
                        "read back from the store)")
    p.add_argument("--lease", dest="lease_s", type=float_at_least(0, strict=True), default=2.0,
                   help="seconds a hand-off may take before the token instance computes the prompt itself")
    p.add_argument("--timeout", dest="timeout_s", type=float_at_least(0, strict=True), default=120.0,
                   help="a request with no answer by then counts as lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_chaos.json")
    p.set_defaults(threads=0)  # (each instance runs one torch thread)


def run(a) -> None:
    from servewise.bench.chaos import Settings, run
    from servewise.commands.bench import settings

    run(settings(Settings, a))
