"""What every benchmark here shares, whatever it trains.

- `env`: this working tree on sys.path, versions, the GPU a run may use;
- `runner`: one subprocess per configuration (memory peaks, compilation caches and
  allocator state never leak from one run into the next), its result as JSON;
- `timing`: a TrainerCallback that times each optimizer step after a synchronize;
- `profiling`: a profiled step's kernels by kind, its Chrome trace;
- `agreement`: do the first logged steps of several runs agree;
- `tables`: markdown tables.

Nothing here knows which trainer or loss it measures: that is `benchmarks/builders/`.
"""
