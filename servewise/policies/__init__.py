"""Pluggable scheduling policies, each registered by name in a plain dict."""
from servewise.policies.ordering import ORDERING_POLICIES
from servewise.policies.preemption import PREEMPTION_POLICIES, SYSTEMS

__all__ = ["ORDERING_POLICIES", "PREEMPTION_POLICIES", "SYSTEMS"]
