"""The benchmarks, together: `python -m engine.bench [--workload ...]` (cli.py) runs each workload
against its baseline side by side in one run and prints ratios (docs/performance.md).

    prompts.py        the seeded benchmark prompts
    cli.py            the command: shared arguments, the workload table, the dispatch
    checks.py         argument checks the workloads share
    throughput.py     throughput against transformers and the machine's matmul bound
    shared_prefix.py  prefix cache on against off
    plugins.py        hook cost, and what skipdetok saves
    tracing.py        tracing off against on
    serve.py          engine serve over HTTP against in-process streams
    beam.py           native beam search against the client-side loop and transformers
    grammar.py        requests under one JSON schema against the same requests unconstrained
"""
