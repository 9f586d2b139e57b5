"""Load tests and benchmarks (locust users and the benchmark report); speaks HTTP only."""
