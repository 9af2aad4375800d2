"""The run services: ``runtime`` wires a run (actors -> transport -> learner -> weights back), over the parts
it is built from, each testable alone: ``guard`` (the fingerprint guard), ``budget`` (when the run ends),
``checkpointer`` (counters, resume, checkpoints), ``log_rows`` and ``periodic_eval`` (``--eval-every``)."""
