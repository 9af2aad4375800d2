"""Imported by ``launch_impala`` before anything loads torch: the learner's idle OpenMP threads sleep
instead of spinning, unless the user set ``OMP_WAIT_POLICY`` themselves.

The learner's second torch thread (``learner_threads``) shares a core with the actors: spinning, it
took that core from them for nothing; sleeping, the run is faster (BENCHMARKS.md, the cost model).
libgomp reads the variable once, when torch is first loaded, so it is set for that load and then taken
back: the processes this one starts (actors, or other programs when the module is imported by a larger
one) keep the user's environment. Where torch was already loaded, this changes nothing.
"""

import os

_USER_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402, F401  (the load that reads the variable)

if _USER_WAIT_POLICY is None:
    del os.environ["OMP_WAIT_POLICY"]
