"""backends.rl.rewards: verifiers on hand-made responses, user functions, DAPO's overlong punishment."""

import textwrap

import pytest

from backends.rl import rewards
from backends.rl.rewards import RewardError, Scorer

GSM8K_CASES = [  # (response, ground truth, strict score, flexible score)
    ("7 + 5 = 12\n#### 12", "12", 1.0, 1.0),
    ("#### 1,152", "1152", 1.0, 0.0),  # commas dropped in strict; flexible takes "1,152" as is
    ("first #### 3 then #### 4", "4", 1.0, 1.0),  # the last answer counts
    ("the answer is 12", "12", 0.0, 1.0),  # no ####: strict gives nothing, flexible takes the last number
    ("#### -48", "-48", 1.0, 1.0),
    ("####12", "12", 0.0, 1.0),  # strict wants "#### " with the space
    ("#### 13", "12", 0.0, 0.0),
]


@pytest.mark.parametrize("response,truth,strict,flexible", GSM8K_CASES)
def test_gsm8k(response, truth, strict, flexible):
    assert rewards.gsm8k(response, truth) == strict
    assert rewards.gsm8k(response, truth, method="flexible") == flexible


def test_gsm8k_looks_at_the_tail_and_format_score():
    assert rewards.gsm8k("#### 12" + " " * 400, "12") == 0.0  # VeRL reads the last 300 characters only
    assert rewards.gsm8k("#### 13", "12", format_score=0.1) == 0.1


MATH_CASES = [
    ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\dfrac{1}{2}", 1.0),
    ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{10\\%}", "10", 1.0),
    ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)", 1.0),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("\\fbox{7}", "7", 0.0),  # VeRL finds a last \\fbox but only unboxes \\boxed
    ("\\boxed{5", "5", 0.0),  # unbalanced
    ("no box: 4", "4", 0.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
]


@pytest.mark.parametrize("response,truth,score", MATH_CASES)
def test_boxed_math(response, truth, score):
    assert rewards.boxed_math(response, truth) == score


def test_exact_and_format():
    assert rewards.exact_match("  Paris\n", "Paris") == 1.0
    assert rewards.exact_match("paris", "Paris") == 0.0
    assert rewards.format_reward("blah\n#### 42") == 1.0
    assert rewards.format_reward("blah 42") == 0.0
    assert rewards.format_reward("<think>x</think><answer>y</answer>", r"^<think>.*</think><answer>.*</answer>$") == 1.0


def test_overlong_penalty_hand_worked():
    # max 100, buffer 20: free up to 80 tokens, then -1/20 * factor per token, -factor at 100
    assert rewards.overlong_penalty(80, 100, 20) == 0.0
    assert rewards.overlong_penalty(50, 100, 20) == 0.0
    assert rewards.overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert rewards.overlong_penalty(100, 100, 20, 0.5) == pytest.approx(-0.5)
    with pytest.raises(RewardError, match="overlong buffer"):
        rewards.overlong_penalty(10, 100, 0)


def test_user_function_module_and_file(tmp_path, monkeypatch):
    code = textwrap.dedent("""
        def score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(len(solution_str) == int(ground_truth)), "extra": 1}

        def plain(data_source, solution_str, ground_truth, extra_info=None):
            return 0.25
        not_callable = 3
    """)
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.load_function("my_rewards:score")
    scorer = Scorer(function=fn)
    assert scorer(["abc", "ab"], ["3", "3"], [3, 2])[0] == [1.0, 0.0]
    assert Scorer(function=rewards.load_function(f"{tmp_path}/my_rewards.py:plain"))(["x"], ["1"], [1])[0] == [0.25]
    for spec, why in [("my_rewards:missing", "AttributeError"), ("no_such_module_xyz:f", "ModuleNotFoundError"),
                      ("my_rewards", "module:function"), (f"{tmp_path}/nope.py:f", "no file"),
                      ("my_rewards:not_callable", "not callable")]:
        with pytest.raises(RewardError, match=why) as err:
            rewards.load_function(spec)
        assert spec.split(":")[0] in str(err.value)
    (tmp_path / "broken_rewards.py").write_text("import not_a_real_dependency_q\n")
    with pytest.raises(RewardError, match="cannot be loaded: ModuleNotFoundError"):
        rewards.load_function("broken_rewards:f")


def test_scorer_routes_by_data_source_and_adds_bonuses():
    s = Scorer(format_weight=0.1, overlong_buffer=4, overlong_factor=1.0, max_response_length=10)
    got, info = s(["#### 3", "\\boxed{3}", "3"], ["3", "3", "3"], [2, 8, 10],
                  ["openai/gsm8k", "lighteval/MATH", "openai/gsm8k"])
    assert info["score"] == [1.0, 1.0, 0.0]
    assert info["format"] == [0.1, 0.0, 0.0]
    assert info["overlong"] == [0.0, pytest.approx(-0.5), pytest.approx(-1.0)]
    assert got == [pytest.approx(1.1), pytest.approx(0.5), pytest.approx(-1.0)]
    with pytest.raises(RewardError, match="no rule reward for data_source 'mystery'"):
        s(["x"], ["1"], [1], ["mystery"])
    assert Scorer(verifier="exact")(["3"], ["3"], [1], ["mystery"])[0] == [1.0]
    with pytest.raises(RewardError, match="verifier must be one of"):
        Scorer(verifier="gsm9k")


@pytest.mark.upstream
def test_verifiers_match_verl():
    gsm = pytest.importorskip("verl.utils.reward_score.gsm8k", reason="verl 0.9.1 is not importable")
    math_reward = pytest.importorskip("verl.utils.reward_score.math_reward")
    for response, truth, _, _ in GSM8K_CASES:
        for method in ("strict", "flexible"):
            assert rewards.gsm8k(response, truth, method=method) == gsm.compute_score(response, truth, method=method)
    for response, truth, _ in MATH_CASES:
        assert rewards.boxed_math(response, truth) == math_reward.compute_score(response, truth)
