"""The library both learners and the actors stand on. Its rooms, bottom up (imports point down only):

- ``algos``: the learning math as pure tensor functions (V-trace, PopArt, the IMPALA losses, PPO's
  formulas, observation normalizers);
- ``run``: the one configuration mechanism and run plumbing (configs, CPUs, checkpoints, metrics, tracking);
- ``envs``: building, probing and fingerprinting environments (Atari, gymnasium, Unity);
- ``nets``: the networks (IMPALA's CNNs/MLP, PPO's policy);
- ``transport``: what travels between processes (trajectory schema, wire format, messages, weights, CURVE);
- ``evaluation``: what a checkpoint holds for playing and the records of an evaluation.
"""
