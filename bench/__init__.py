"""Benchmarks (run as modules, e.g. `python -m bench.ledger`); not part of the test suite."""
