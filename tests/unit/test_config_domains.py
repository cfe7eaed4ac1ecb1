"""Every config field has a declared domain (config/domains.py): the walk over the sections finds an entry
for each, of the kind its type needs; every default and every preset value lies inside; a value just
outside each numeric bound is refused at build time in one line naming the key, the value and the domain,
and the value just inside is accepted. A hand-written list of values outside their meaning (the issue's
`--min-lr-ratio 2` among them) and of the "0 = auto / off" values the domains must admit checks the table
itself; `threefold train --help` shows each option's domain."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from threefold.config import Config, load_config, with_overrides
from threefold.config.domains import BY_TYPE, DOMAINS, Choices, Pattern, Range, Text
from threefold.config.presets import PRESETS
from threefold.config.sections import Sections
from threefold.errors import ConfigError


def walk() -> list[tuple[str, object, object]]:
    """(key, type, default) of every field of every section."""
    out = []
    for section in dataclasses.fields(Sections):
        cls = typing.get_type_hints(Sections)[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f"{section.name}.{f.name}", hints[f.name], default))
    return out


def _numbers(kind) -> set:
    """The number types a field's type admits (int | Literal["auto"] -> {int})."""
    members = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, type(int | str)) else (kind,)
    return {m for m in members if m in (int, float)}


def test_every_field_has_a_domain_of_its_kind_and_its_default_inside():
    keys = {key for key, _, _ in walk()}
    assert keys - set(DOMAINS) == set(), "give these fields a domain in config/domains.py"
    assert set(DOMAINS) - keys <= {"run.threads"}, "these domains name no field"
    for key, kind, default in walk():
        domain = DOMAINS[key]
        flag_or_choice = kind is bool or typing.get_origin(kind) is typing.Literal
        assert (domain is BY_TYPE) == flag_or_choice, key  # the type is the domain exactly for these
        if _numbers(kind):
            assert isinstance(domain, Range), key
        elif kind is str:
            assert isinstance(domain, (Text, Choices, Pattern)), key
        if isinstance(domain, Text):
            assert domain.kind in ("path", "parsed", "free") and domain.text, key
        numeric_default = isinstance(domain, Range) and not isinstance(default, str)  # not save_every's "auto"
        if numeric_default or isinstance(domain, (Choices, Pattern)):
            assert domain.admits(default), f"{key}: its default {default!r} is outside {domain.text}"
    assert load_config(None, []) == Config()  # the defaults build


def test_every_preset_value_is_inside_its_domain():
    for name in PRESETS:
        cfg = load_config(None, [f"model.preset={name}"])
        assert cfg.model.preset == name


def _edges(key: str, domain: Range, integer: bool) -> list[tuple[str, str]]:
    """(just outside, just inside) for each finite bound, as override text."""
    out = []
    for bound, is_open, side in ((domain.lo, domain.lo_open, -1), (domain.hi, domain.hi_open, +1)):
        if math.isinf(bound):
            continue
        if integer:
            assert not is_open, f"{key}: an integer bound is written closed"
            out.append((str(bound + side), str(bound)))
        else:
            step = 1e-9 * max(1.0, abs(bound))
            out.append((repr(float(bound)), repr(bound - side * step)) if is_open
                       else (repr(bound + side * step), repr(float(bound))))
    return out


RANGED = [(key, kind) for key, kind, _ in walk() if isinstance(DOMAINS.get(key), Range)]


@pytest.mark.parametrize("key, kind", RANGED, ids=[k for k, _ in RANGED])
def test_just_outside_each_bound_is_refused_and_just_inside_accepted(key, kind):
    domain = DOMAINS[key]
    edges = _edges(key, domain, float not in _numbers(kind))
    assert edges, f"{key}: a numeric domain without a finite bound"
    for outside, inside in edges:
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}={outside}"])
        assert e.value.field == key and str(e.value).startswith(f"{key}: must ") and "\n" not in str(e.value)
        assert str(e.value).endswith(f", got {float(outside) if float in _numbers(kind) else int(outside)}")
        assert (domain.text.split(" (")[0] in str(e.value)) or "exceed" in str(e.value)
        assert getattr(load_config(None, [f"{key}={inside}"]), key.split(".")[0]) is not None


@pytest.mark.parametrize("key", [k for k, _, _ in walk() if isinstance(DOMAINS.get(k), (Choices, Pattern))])
def test_a_string_outside_its_choices_or_shape_is_refused(key):
    with pytest.raises(ConfigError, match=f"^{key}: must be .*, got 'no such;thing'$"):
        load_config(None, [f"{key}=no such;thing"])


# written by hand from each key's meaning, not from the table
REFUSED = ["train.min_lr_ratio=2", "train.min_lr_ratio=-0.1", "train.beta1=1", "train.beta2=-0.5", "train.eps=0",
           "train.grad_clip=-1", "train.warmup_steps=-3", "train.seed=-1", "model.lora_dropout=1",
           "model.norm_eps=0", "model.ffn_hidden=0", "model.max_seq=0", "model.experts_top_k=0",
           "model.init_std=-0.02", "run.threads=-1", "checkpoint.keep=-1", "parallel.zero=4",
           "precision.growth_factor=1", "precision.backoff_factor=0", "compress.warmup_steps=-2",
           "train.easgd_alpha=1", "fault.rank=-2", "fault.step=-1", "fault.signal=SIGKILL",
           "debug.comm_semantics=mpi", "model.lora_targets=q_proj;v_proj", "train.lr=nan"]
ADMITTED = ["parallel.dp=0", "run.threads=0", "train.grad_clip=0", "checkpoint.save_every=0",
            "checkpoint.save_every=auto", "checkpoint.keep=0", "compress.warmup_steps=-1", "fault.rank=-1",
            "model.head_size=0", "model.loss_chunk=0", "model.experts=0", "model.expert_ffn_hidden=0",
            "model.expert_capacity=0", "model.lora_rank=0", "model.lora_alpha=0", "train.steps=0",
            "train.eval_every=0", "debug.history=0", "debug.hang_timeout_s=0", "data.prefetch=0",
            "parallel.elastic_world=0", "train.min_lr_ratio=1", "train.min_lr_ratio=0", "train.momentum=0",
            "fault.signal=SIGINT,SIGUSR1", "model.lora_targets=q_proj, v_proj"]


@pytest.mark.parametrize("override", REFUSED)
def test_values_outside_their_meaning_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert e.value.field == key and "must" in str(e.value)


@pytest.mark.parametrize("override", ADMITTED)
def test_zero_auto_and_off_values_are_admitted(override):
    load_config(None, [override])


def test_with_overrides_and_validate_check_domains_too():
    with pytest.raises(ConfigError, match=r"^train.min_lr_ratio: must be in \[0, 1\], got 2.0$"):
        with_overrides(Config(), train={"min_lr_ratio": 2.0})
    made = dataclasses.replace(Config(), train=dataclasses.replace(Config().train, min_lr_ratio=2.0))
    with pytest.raises(ConfigError, match="train.min_lr_ratio"):
        made.validate(1)


def test_the_cli_refuses_in_one_line_and_the_help_shows_each_domain(tmp_path, capsys):
    from threefold.cli import main
    from threefold.train.command import OPTION_KEYS

    assert main(["train", "--min-lr-ratio", "2", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["threefold: error: train.min_lr_ratio: must be in [0, 1], got 2.0"]
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, key in OPTION_KEYS.items():
        domain = DOMAINS[key]
        if domain is not BY_TYPE and key != "model.preset":
            assert f"sets {key}; {domain.text}" in text, key
    assert "sets train.min_lr_ratio; in [0, 1];" in text and "sets run.threads; at least 0 (0 = auto)" in text
    assert "sets checkpoint.save_every; at least 0 (0 = never), or auto;" in text
