"""The peer benchmark (`python benchmarks/bench_peer.py`): edge-agent against LiteRT-LM and the
memory-bandwidth limit, one module per section over a shared harness.

* `spec`: the models, engines, prompt lengths and other constants every part shares;
* `models`: building the models, packing the LiteRT-LM bundles, the bench profiles;
* `roofline`: read bandwidth, bytes read per decoded token, the ceilings;
* `measure`: peak RSS, the prompt texts and a stream's timing, which every worker uses;
* `workers`: what runs in each contender's fresh process (`bench_peer.py --worker ...`);
* `harness`: the parent's side: the prompt texts, spawning a worker, medians of its results;
* `section_main`, `section_windows`, `section_continue`: one section each, its runner and its
  tables;
* `report`: the plot and the PERFORMANCE.md section.
"""
