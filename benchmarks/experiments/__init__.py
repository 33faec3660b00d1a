"""One-off experiments, apart from the harness and the tools a user runs (benchmarks/).

Each answered a question once (where a call's time goes, whether layers share the XLA
work, persistent against one unit per program, how the timing method moves a figure);
their findings are written down in BUILD_NOTES.md and their results kept in
benchmarks/results/archive/. Run one as ``python -m benchmarks.experiments.NAME``.
"""
