"""The learner's entry points: the console scripts (``launch_impala``, ``launch_ppo``, ``impala-eval``,
``impala-export``, ``frameskip_check``) and what only they use (``hosts``: one learner rank per host;
``sleeping_threads``: imported before torch). Only wiring and the command line: they build the settings and
hand them to the run services (:mod:`learner.run`) and the learners one floor down."""
