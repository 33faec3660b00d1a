"""Benchmarks and GPU checks for pallas_prefill (run on the GPU; see BUILD_NOTES.md)."""
