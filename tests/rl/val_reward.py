"""A reward for the validation tests (tests/rl/val_reward.py:graded): a dict as VeRL's reward functions may
return it, so the validation metrics have extra variables (acc) and a vote (pred, for maj@)."""


def graded(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    return {"score": digits / max(len(solution_str), 1), "acc": float(digits >= 2), "pred": str(digits % 3)}
