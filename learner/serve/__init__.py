"""The learner's receiving side: ``server`` (the ZeroMQ sockets and the receive thread) asks ``admission``
(who may feed the learner: a pure policy) and sums ``episode_stats`` from the unrolls it accepted."""
