"""The learning math of both algorithms as pure tensor functions: V-trace, PopArt and the IMPALA
losses; PPO's formulas in their ML-Agents and SB3 flavours; observation normalizers."""
