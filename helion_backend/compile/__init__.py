"""The compile side: the FX pass pipeline Inductor runs as its post-grad custom pre pass.

It reads the graph, the options, the rules and the config tables, and writes the rewritten graph, the
report and the manifest. It never imports Helion, Triton, the run time or the kernels.
"""
