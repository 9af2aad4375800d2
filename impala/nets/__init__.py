"""Networks: IMPALA's torsos and heads (shallow/deep/Nature CNN, MLP, LSTM core) and PPO's policy."""
