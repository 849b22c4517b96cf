"""The analysis tools: what a measurement means, beside the runners that make them (benchmarks/).

predict (N-device step and efficiency from a 1-device one), breakdowns (where a step's time
went, from profiler traces), comm_probe (each framework's gradient collective alone), ab (one
trainer, two settings, alternating), mfu (model FLOP utilisation of throughput tables),
gpu_verdicts (the verdicts on a GPU check's outputs). Each reads JSON records, never Markdown.
"""
