"""Per-trainer builders: the model, the data and the trainer for one configuration.

`model` builds the random model every run starts from; `dpo` and `grpo` build ours and
TRL's trainer for a configuration of `dpo_configs` / `grpo`; `lengths` draws real-length
preference pairs.
"""
