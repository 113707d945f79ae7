"""The scheduler process: owns the model and KV memory; receives, schedules, runs, samples, emits."""
