"""py-spy profiling of the engine's three processes: `engine profile -- python run.py`, `engine dump`.

discover.py finds the processes by their titles, pyspy.py runs py-spy and explains its failures,
stacks.py turns py-spy's collapsed stacks into a flamegraph SVG and a speedscope JSON, breakdown.py
maps samples to the engine's stages and reads the result, cli.py is the command line.
"""
