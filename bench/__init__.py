"""Benchmarks, installed as `llamarl_core.bench` so that `llamarl bench ...` runs them."""
