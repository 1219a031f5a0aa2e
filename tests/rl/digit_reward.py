"""Reward functions for the RL loop tests (loaded as tests/rl/digit_reward.py:<name>): learnable by the
tiny random model within a few steps, unlike arithmetic."""


def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are digits."""
    return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)


def many_digits(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response has at least 6 digits (a pass / fail reward: some groups are all equal)."""
    return float(sum(ch.isdigit() for ch in solution_str) >= 6)
