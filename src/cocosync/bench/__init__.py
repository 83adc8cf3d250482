"""Benchmark suites: ours and the baselines side by side in one run (``cocosync bench ...``).

``common`` holds what every suite shares: timing with medians, bandwidth, rich tables and JSON records.
"""
