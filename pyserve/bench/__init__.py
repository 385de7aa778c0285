"""`pyserve bench`: the load and latency tool (serve: against a running server; offline: the
in-process Engine; one-batch: one static batch on the ModelRunner). See pyserve.bench.cli."""
