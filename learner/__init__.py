"""The learner: the two learners' compute (``vtrace_learner``, the IMPALA update step, with ``update/``
around it: staging, health metrics, CPU use; ``ppo_learner`` + ``ppo_modes``), the learner group
(``group``, started by ``cli/group_start``), the evaluation engine (``evaluator``) and the Python API
(``api``), with their rooms: ``cli/`` (the console scripts), ``run/`` (the run services: runtime,
checkpoints, budget, ...) and ``serve/`` (the trajectory server, its admission policy and episode
statistics). Imports point down: api -> cli -> run -> serve, and each of them onto the learners, the actors
and the library."""
