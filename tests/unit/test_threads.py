"""run.threads: torch's CPU threads per process, from the setting, OMP_NUM_THREADS or the fair share."""

import pytest

from threefold.config import load_config
from threefold.errors import ConfigError, UserError
from threefold.train.threads import choose_cpu_threads


def test_a_setting_wins_over_the_environment_and_the_cores():
    assert choose_cpu_threads(3, "5", 16, 2) == (3, "run.threads")
    assert choose_cpu_threads(1, None, 64, 1) == (1, "run.threads")


def test_omp_num_threads_is_the_default_when_set():
    assert choose_cpu_threads(0, "5", 16, 2) == (5, "OMP_NUM_THREADS")
    assert choose_cpu_threads(0, "1", 2, 1) == (1, "OMP_NUM_THREADS")  # one process on 2 busy cores
    assert choose_cpu_threads(0, "4,2", 16, 2) == (4, "OMP_NUM_THREADS")  # OpenMP's nested levels: the first


@pytest.mark.parametrize("cores, local, expected", [(2, 1, 2), (2, 2, 1), (16, 3, 5), (2, 4, 1), (8, 1, 8)])
def test_otherwise_the_cores_are_shared_among_the_local_processes(cores, local, expected):
    assert choose_cpu_threads(0, None, cores, local) == (expected, "cores/local")
    assert choose_cpu_threads(0, "", cores, local) == (expected, "cores/local")  # set but empty: unset


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_an_omp_num_threads_that_is_not_a_count_is_one_line(value):
    with pytest.raises(UserError, match="OMP_NUM_THREADS=.* is not a positive whole number"):
        choose_cpu_threads(0, value, 2, 1)


def test_a_negative_setting_names_the_key():
    with pytest.raises(ConfigError) as caught:  # the key's domain, before any thread count is chosen
        load_config(None, ["run.threads=-1"])
    assert caught.value.field == "run.threads"
