"""`threefold plan` prints a parameter count in the unit that fits it."""

from threefold.cli import main
from threefold.planner.command import parameter_count


def test_parameter_counts_use_a_fitting_unit(capsys):
    assert [parameter_count(n) for n in (950, 404_000, 12_300_000, 1_200_000_000)] == ["950", "404k", "12.3M", "1.2B"]
    assert main(["plan", "--model", "tiny", "--gpus", "8"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "k parameters" in first and "e-0" not in first and "0.0" not in first.split("parameters")[0], first
