"""Hand-written kernels for backends where XLA's own code is the bottleneck (XLA FFI custom calls)."""
