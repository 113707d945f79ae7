"""The sample stage: logit processing (custom processors, bias, penalties), logprobs and sampling, each
as tensor operations over the whole batch. Runs in the scheduler process."""
