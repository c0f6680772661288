"""Evaluation: compute, throughput and quality metrics."""
