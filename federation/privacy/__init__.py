"""Differential privacy: the mechanisms, their accountants and the server's secret."""
