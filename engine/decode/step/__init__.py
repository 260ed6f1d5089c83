"""The step side: a Batch of rows in, a StepOutput out (the runner's forward, the logit rules,
sampling, the device's beam choice, CUDA graphs). It never sees a Request."""
