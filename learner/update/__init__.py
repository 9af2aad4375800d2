"""What surrounds the IMPALA update step (``learner.vtrace_learner``): a batch's staging onto the device
(``staging``), the health metrics measured around each step (``health``) and how the learner uses this
machine's CPU (``precision``: torch threads, bf16 or not)."""
