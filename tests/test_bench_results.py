"""bench/results.py rewrites one benchmark's section of RESULTS.md in place."""

from bench.results import replace_section

DOC = """# Benchmark results

intro

## LLM engine memory (a.py)

old memory

## LLM engine (b.py)

old speed

## RL engine (c.py)

rl
"""


def test_a_section_is_replaced_where_it_stands():
    out = replace_section(DOC, "## LLM engine (b.py)", "## LLM engine (b.py)\n\nnew speed\n")
    assert out.index("## LLM engine memory") < out.index("new speed") < out.index("## RL engine")
    assert "old speed" not in out and "old memory" in out and "intro" in out and out.endswith("rl\n")


def test_a_heading_that_only_shares_a_prefix_is_left_alone():
    out = replace_section(DOC, "## LLM engine", "## LLM engine\n\nother\n")
    assert "old memory" in out and "old speed" in out and out.endswith("## LLM engine\n\nother\n")


def test_replacing_twice_gives_the_same_file():
    once = replace_section(DOC, "## RL engine (c.py)", "## RL engine (c.py)\n\nx\n")
    assert replace_section(once, "## RL engine (c.py)", "## RL engine (c.py)\n\nx\n") == once
