"""Benchmarks and comparison harnesses (python -m benchmarks.<name>; benchmarks/README.md). A regular package, so that
a stray top-level ``benchmarks`` package another distribution installs (opacus 1.6 ships one) cannot shadow it."""
