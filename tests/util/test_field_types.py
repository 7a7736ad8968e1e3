"""The config classes' shared field checks: types by annotation, and lower bounds."""

import math
from dataclasses import dataclass

import pytest

from ktm import KTMError
from ktm.bench.config import BenchConfig
from ktm.serving.config import ServeConfig
from ktm.tasks.corpus import WindowSpec
from ktm.training.config import TrainConfig
from ktm.util.field_types import check_at_least


@dataclass
class Sizes:
    n_train: object = 1
    warmup: object = 0


@pytest.mark.parametrize("n_train,warmup,message", [
    (0, 0, "n_train must be >= 1, got 0"),
    (1, -1, "warmup must be >= 0, got -1"),
    (math.nan, 0, "n_train must be >= 1, got nan"),
    ("3", 0, "n_train must be a number >= 1, got '3'"),
    (True, 0, "n_train must be a number >= 1, got True"),
])
def test_a_value_below_its_bound_or_not_a_number_is_named(n_train, warmup, message):
    def check(obj, flags=False):
        check_at_least(obj, 1, "n_train", flags=flags)
        check_at_least(obj, 0, "warmup", flags=flags)

    with pytest.raises(KTMError, match=f"^{message}$"):
        check(Sizes(n_train, warmup))
    with pytest.raises(KTMError, match=f"^--{message.replace('_', '-')}$"):
        check(Sizes(n_train, warmup), flags=True)


def test_bounds_at_the_limit_pass():
    check_at_least(Sizes(1, 0), 1, "n_train")
    check_at_least(Sizes(1.5, 0.0), 0, "n_train", "warmup")


@pytest.mark.parametrize("build,message", [
    (lambda: TrainConfig(out_dir="x", grad_accum=0), "grad_accum must be >= 1, got 0"),
    (lambda: TrainConfig(out_dir="x", save_every=-1), "save_every must be >= 0, got -1"),
    (lambda: ServeConfig(max_queue=0), "max_queue must be >= 1, got 0"),
    (lambda: ServeConfig(threads="2"), "threads must be a number >= 0, got '2'"),
    (lambda: ServeConfig(quote="near"), "quote must be one of far, all, got 'near'"),
    (lambda: BenchConfig(repeats=0), "repeats must be >= 1, got 0"),
    (lambda: WindowSpec(target_tokens=0), "target_tokens must be >= 1, got 0"),
])
def test_every_config_class_checks_its_bounds_through_it(build, message):
    with pytest.raises(KTMError, match=f"^{message}$"):
        build()
