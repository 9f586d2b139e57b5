"""Kubernetes deployment: render, plan, validate and apply LeaderWorkerSet, Service and PathwaysJob.

Runs on a laptop: nothing here imports JAX.
"""
