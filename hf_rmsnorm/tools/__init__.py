"""The tooling behind ``scripts/``: presets and loading, the verify workload, parity and speed measurements,
fine-tuning, kernel benchmarks and offline inspection. Imports ``patch`` and ``ops``; the library never imports
this wing."""
