"""DeepSpeed ZeRO-1/2/3: the run's ZeRO settings read and applied (`zero`), and ZeRO with stock DDP's optimizer semantics (`zero_unused`, opt-in)."""
