"""Evaluation: decide whether hardware A, kernel B or model variant C is really better.

Measurements come from the harness; `torchhal.evaluation.stats` turns per-run aggregates into
tests, intervals and decisions a careful reviewer accepts.
"""
