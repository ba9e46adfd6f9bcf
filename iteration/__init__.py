"""The outer loop (DeepSeekMath Algorithm 1): manifest and resume, reward-model refresh with the
replay buffer, reference reset, per-iteration evaluation, summary and plot."""
