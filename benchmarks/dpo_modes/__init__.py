"""The modes of `benchmarks/e2e_dpo.py`, one module each.

- `compare`: the fixed-length comparison (tables, agreement check, targets), also with
  --precompute_ref_log_probs, --gradient_checkpointing, --profile/--trace and
  --memory_snapshot, which the worker (`worker`) carries out per run;
- `real_lengths`: preference pairs at real lengths (--real_lengths DATASET);
- `search`: the longest length that fits (--max_length_search);
- `fit`: peak memory against length and its verification (--memory_fit, --verify_fit);
- `recheck`: the tables and check of an earlier run's results.json (--recheck);
- `memory`: what the memory-snapshot mode records and prints;
- `args`: the command line; `launch`: one configuration in its own subprocess.
"""
