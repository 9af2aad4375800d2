"""What travels between actors and the learner: the one trajectory schema, the wire format, the
typed messages (agent spec, run info), weights as named arrays, and CURVE keys."""
