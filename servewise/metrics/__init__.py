from servewise.metrics.summary import SLO, RequestRecord, compute, format_table, save_json

__all__ = ["SLO", "RequestRecord", "compute", "format_table", "save_json"]
