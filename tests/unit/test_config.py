import pytest

from threefold.config import Config, load_config
from threefold.errors import ConfigError


def test_defaults_presets_and_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "small"\nlayers = 6\n[train]\nlr = 1\n')
    cfg = load_config(toml, ["train.steps=7", "parallel.tp=2", "train.deterministic=true"])
    assert cfg.model.hidden == 256 and cfg.model.layers == 6  # preset, then file
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 7 and cfg.parallel.tp == 2 and cfg.train.deterministic is True
    with pytest.raises(Exception):
        cfg.train.steps = 3  # frozen


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["model.preset=tiny-llama", "train.lr=0.003", "data.source=stdlib"])
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg


def test_validate_fills_dp():
    assert load_config(None, ["parallel.tp=2"]).validate(4).parallel.dp == 2


@pytest.mark.parametrize("overrides, world, field, words", [
    (["model.foo=1"], 1, "model.foo", "unknown key"),
    (["modle.layers=1"], 1, "modle.layers", "unknown config section"),
    (["model.layers=four"], 1, "model.layers", "expected int"),
    (["train.deterministic=maybe"], 1, "train.deterministic", "expected bool"),
    (["model.mlp=relu"], 1, "model.mlp", "not one of"),
    (["model.preset=gpt5"], 1, "model.preset", "unknown preset"),
    (["parallel.tp=2", "parallel.pp=2"], 6, "parallel", "product is 6"),
    (["parallel.dp=3"], 4, "parallel", "does not match the world size 4"),
    (["parallel.zero=4"], 1, "parallel.zero", "must be in [0, 3] (the ZeRO stage), got 4"),
    (["train.global_batch=6"], 4, "train.global_batch", "multiple of 4"),
    (["data.source=/no/such/dir"], 1, "data.source", "does not exist"),
    (["train.seq_len=100"], 1, "train.seq_len", "max_seq"),
    (["model.heads=5"], 1, "model.hidden", "not divisible"),
    (["parallel.pp=3"], 3, "parallel.pp", "layers"),
    (["fault.rank=4"], 4, "fault.rank", "does not exist"),
    (["train.optimizer=lamb"], 1, "train.optimizer", "not one of adamw, sgd"),
    (["train.optimizer=sgd", "train.momentum=1.0"], 1, "train.momentum", "[0, 1)"),
    (["train.optimizer=sgd", "train.momentum=0", "train.nesterov=true"], 1, "train.nesterov", "momentum > 0"),
    (["train.nesterov=true"], 1, "train.nesterov", "optimizer=sgd"),
    (["train.lr=0"], 1, "train.lr", "positive"),
    (["model.loss_chunk=-1"], 1, "model.loss_chunk", "at least 0"),
    (["train.min_lr_ratio=2"], 1, "train.min_lr_ratio", "must be in [0, 1], got 2.0"),  # a domain (domains.py)
    (["run.log_every=10"], 1, "run.log_every", "unknown key"),  # it did nothing: removed, not kept silent
    (["train.optimizer=sgd", "compress.method=onebit", "compress.warmup_steps=5"], 4, "compress.onebit_adam",
     "train.optimizer=adamw"),
])
def test_mistakes_name_the_field_and_the_fix(overrides, world, field, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides).validate(world)
    assert info.value.field == field
    assert words in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    bad.write_text("[model]\nlayers = 'four'\n")
    with pytest.raises(ConfigError, match="model.layers: expected int"):
        load_config(bad)
    bad.write_text("[optimizer]\nlr = 1\n")
    with pytest.raises(ConfigError, match="unknown config section"):
        load_config(bad)


def test_every_section_is_typed():
    cfg = Config()
    assert set(cfg.to_dict()) == {"model", "parallel", "pipeline", "precision", "remat", "compress", "train",
                                  "data", "checkpoint", "run", "debug", "fault"}


def test_the_checks_read_only_the_sections():
    """config/load.py calls the checks; they (and the sections) never import config.py back, not even for annotations."""
    import ast
    from pathlib import Path

    import threefold

    root = Path(threefold.__file__).parent
    for name in ("config/sections", "config/checks", "config/moe_checks", "config/elastic"):
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & {"load", "config", "threefold.config", "threefold.config.load"}, f"{name}.py imports config/load.py"


# Each mistake above, and the fix its message suggests: the fix is written in the message, and with
# it applied the config validates (or fails on something else, more specific).
FOLLOWED = [
    (["model.foo=1"], 1, [], "unknown key"),
    (["train.seq_len=100"], 1, ["model.max_seq=100"], "model.max_seq=100"),
    (["parallel.tp=2", "parallel.pp=2"], 6, ["parallel.pp=1"], "product is 6"),
    (["parallel.zero=4"], 1, ["parallel.zero=3"], "must be in [0, 3]"),
    (["train.global_batch=6"], 4, ["train.global_batch=8"], "multiple of 4"),
    (["model.heads=5"], 1, ["model.heads=4"], "model.heads=5"),
    (["parallel.pp=3"], 3, ["model.layers=3"], "at most 2 stages"),
    (["train.optimizer=sgd", "train.momentum=1.0"], 1, ["train.momentum=0.9"], "must be in [0, 1)"),
    (["train.nesterov=true"], 1, ["train.optimizer=sgd"], "optimizer=sgd"),
    (["pipeline.schedule=zb-h1"], 1, ["pipeline.schedule=1f1b"], "parallel.pp > 1"),
    (["parallel.offload=optimizer"], 1, ["parallel.zero=1"], "--zero 1"),
]


@pytest.mark.parametrize("mistake, world, fix, says", FOLLOWED)
def test_the_suggested_fix_leads_to_a_run(mistake, world, fix, says):
    with pytest.raises(ConfigError) as info:
        load_config(None, mistake).validate(world)
    assert says in str(info.value), str(info.value)
    fixed = [m for m in mistake if m.split("=")[0] not in {f.split("=")[0] for f in fix}] + fix
    if mistake == ["model.foo=1"]:
        fixed = []  # "unknown key": drop it
    try:
        load_config(None, fixed).validate(world)
    except ConfigError as e:  # a different, more specific mistake is fine; the same one is not
        assert e.field != info.value.field, f"the fix for {info.value} leads back to {e}"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_longer_context_for_a_hugging_face_model(family, tmp_path):
    """--seq-len past config.json's positions: a rope family is told to raise model.max_seq, which then runs
    with one warning; a learned-position family (GPT-2) is told the limit, which then runs."""
    pytest.importorskip("transformers")
    from tests.hf_tasks import save_tiny
    from threefold.train.inputs import warnings_for

    directory = save_tiny(family, tmp_path / family)  # 64 positions
    base = [f"model.preset=hf:{directory}", "train.global_batch=2"]
    with pytest.raises(ConfigError) as info:
        load_config(None, base + ["train.seq_len=200"]).validate(1)
    if family == "llama":
        assert "model.max_seq=200" in str(info.value)
        cfg = load_config(None, base + ["train.seq_len=200", "model.max_seq=200"]).validate(1)
        (warning,) = [w for w in warnings_for(cfg) if w.startswith("model.max_seq")]
        assert "exceeds the 64 positions" in warning
    else:
        assert "train.seq_len <= 64" in str(info.value)
        with pytest.raises(ConfigError, match="learned position table"):
            load_config(None, base + ["model.max_seq=200"])
        cfg = load_config(None, base + ["train.seq_len=64"]).validate(1)
        assert not [w for w in warnings_for(cfg) if w.startswith("model.max_seq")]


def test_to_dict_is_the_dataclasses_dict_and_a_copy():
    """to_dict walks the sections shallowly (every field is a scalar); the standard library's deep
    asdict is the reference, on a config with every section holding a value away from its default."""
    import dataclasses

    c = load_config(None, ["model.preset=tiny", "parallel.zero=2", "pipeline.schedule=zb-h1", "precision.compute=bf16",
                           "remat.policy=full", "compress.method=onebit", "train.steps=7", "data.pack=true",
                           "checkpoint.keep=2", "run.plot=false", "debug.stats=true", "fault.kind=nan"])
    got = c.to_dict()
    assert got == dataclasses.asdict(c)
    got["train"]["steps"] = 99  # the caller's dict, not the config's
    assert c.train.steps == 7 and c.to_dict()["train"]["steps"] == 7
