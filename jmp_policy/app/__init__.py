"""The application: the jmp-policy command, demo, doctor and benchmarks."""
