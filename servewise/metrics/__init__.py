"""One vocabulary of serving metrics for single engines, clusters, real and simulated runs, all from
per-request timestamps (RequestRecord): TTFT, TPOT (Splitwise's TBT), ITL and E2E(L) with their
percentiles (summary), slowdowns against an unloaded machine and Splitwise's SLOs on them (slowdown)."""
from servewise.metrics.summary import SLO, RequestRecord, compute, format_table, percentile, save_json

__all__ = ["SLO", "RequestRecord", "compute", "format_table", "percentile", "save_json"]
