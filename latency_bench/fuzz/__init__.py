"""The wire fuzzer (`python -m latency_bench fuzz`); `run` has the whole story."""

from latency_bench.fuzz.run import ALL, failure_report, main_fuzz, run_fuzz, summary_lines

__all__ = ["ALL", "failure_report", "main_fuzz", "run_fuzz", "summary_lines"]
