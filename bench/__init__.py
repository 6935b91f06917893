"""oscar's maintained benchmarks: run each from the repository root as `python -m bench.NAME` (bench/README.md lists
them, what they measure, their commands and their results files in bench/results/)."""
