"""Reproductions of the source papers' experiments."""
