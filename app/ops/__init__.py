"""Tools for operators, tests and benchmarks: preflight checks, a local launch, real faults, the oracle
engine and an OpenAI-client driver."""
