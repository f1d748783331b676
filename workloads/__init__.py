"""Workloads that pos is shown and measured on (see harness.py)."""
