"""`fusedalign verify`: proof, on the user's own model, data, flags and hardware, that the
fused head trains as the unfused one and N processes train as one.

A few optimizer steps of the real trainer, run by the real launcher (`accelerate launch`
with the user's config), compared with a one-process unfused float32 oracle over the same
global batches: per-step loss, gradient norm, every logged value, final weights.

  plan.py       verify's flags, and the runs they ask for grouped into launches
  worker.py     what a launched process runs: the trainer as `fusedalign TRAINER` builds it
  processes.py  starting the launches, collecting what failed
  compare.py    the comparison with the oracle and the per-dtype tolerances
  report.py     the table and the verdicts
  inject.py     known bug classes, for `--self_test` only
  selftest.py   `fusedalign verify --self_test`: each injected bug must be caught
"""
