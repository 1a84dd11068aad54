"""Value types that cross the scheduler/runner/model boundary, below all three.

`plan.StepPlan` is what the scheduler hands the runner for one step (which tokens of which
requests, from which state rows, into which rows and blocks); `batch.ForwardBatch` is the device
metadata the runner builds from it and the model reads; `caches.LayerCaches` the pools' tensors the
model's forward reads and writes; `sampling.StepSampling` (in the plan) says how to sample and score, and
`result.StepResult` is what the runner hands back. None imports the engine, the runner or the models, so
every layer can import them downward.
"""
