"""The GEMV benchmark (`python benchmarks/bench_gemv.py`): XNNPACK's quantized FULLY_CONNECTED
kernels alone, against the measured read bandwidth.

* `chain`: the model (SmolLM-135M's weight matrices chained at batch 1), built and cached;
* `weights`: what the file holds: op counts and the bytes of its FULLY_CONNECTED weights;
* `measure`: one file on XNNPACK: how it is partitioned, ms per pass, the other processes' CPU;
* `rounds`: the alternating rounds under the bench lock, contended measurements retried;
* `summary`: medians over the uncontended rounds, the table and the PERFORMANCE.md text.
"""
