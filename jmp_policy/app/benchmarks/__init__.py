"""Benchmarks, shipped in the package so that `jmp-policy bench` runs from a wheel."""
