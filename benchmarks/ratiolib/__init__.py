"""Reporting for benchmarks/ratio_switch.py."""
