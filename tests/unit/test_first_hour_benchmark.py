"""benchmarks/training/first_hour.py's arithmetic: medians per tree, the slowest refusal, the README's stated time.

Nothing here times anything: the samples are made up, and nothing is appended to a benchmark table.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.training import first_hour


def test_medians_per_tree_and_the_slowest_refusal_are_the_targets_values():
    samples = {"this": {"estimate": [{"seconds": 1.0}, {"seconds": 4.0}, {"seconds": 2.0}],
                        "error_bad_format": [{"seconds": 0.4}], "error_unknown_recipe": [{"seconds": 0.9}]},
               "baseline": {"estimate": [{"seconds": 15.0}], "error_bad_format": [{"seconds": 13.0}],
                            "error_unknown_recipe": [{"seconds": 1.2, "unexpected": ["Traceback"]}]}}
    medians = first_hour.summarize(samples)
    assert medians["this"] == {"estimate": 2.0, "error_bad_format": 0.4, "error_unknown_recipe": 0.9,
                               "argument_errors": 0.9}
    # a run that did not exit as expected is no time at all, and leaves its command (and the slowest) unknown
    assert medians["baseline"]["error_unknown_recipe"] is None and medians["baseline"]["argument_errors"] is None


def test_the_quick_start_goal_is_read_from_the_readme(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("the model writes after `def `. Expect 3 to\n8 minutes on 2 CPU cores (measured ...)")
    assert first_hour.readme_minutes(readme) == (3, 8)
    assert first_hour.readme_minutes(Path(first_hour.ROOT) / "README.md") is not None


def test_every_refusal_expects_exit_2_and_the_rest_success(tmp_path):
    found = first_hour.commands(tmp_path, "this", 0)
    assert {name for name, (_, code) in found.items() if code == 2} == {n for n in found if n.startswith("error_")}
    assert len([n for n in found if n.startswith("error_")]) == 6
    assert found["error_used_directory"][0][:2] == ["train", "recipes/default.yaml"]  # a train into a used folder


def test_the_readmes_cpu_times_are_stated_for_an_idle_machine():
    # Measured on idle cores; on a busy machine a reader took a doubled time for a fault.
    import re

    text = " ".join((Path(first_hour.ROOT) / "README.md").read_text().split())
    stated = re.findall(r"minutes on 2 (\w+ )?CPU cores", text)
    assert stated and all(word == "idle " for word in stated), stated
