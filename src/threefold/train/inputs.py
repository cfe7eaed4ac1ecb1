"""Checks of what the user passed that the config alone cannot see: process counts and data files.

They run before any process starts, so a mistake ends in one line and exit code 2 instead of a
traceback from every rank.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..errors import ConfigError, UserError

_SMALL_FILE_BYTES = 1 << 20  # files this small are read once here to count their tokens


def check_nproc(nproc: int | None) -> None:
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc: {nproc} is not a number of processes; give 1 or more "
                        "(or leave it out to train in this process)")


def check_data(cfg: Config) -> None:
    """An empty data file, or one shorter than one training sample (seq_len + 2 tokens)."""
    need = cfg.train.seq_len + 2
    path = Path(cfg.data.source)
    if cfg.data.source in ("synthetic", "stdlib") or not path.is_file():
        return
    size = path.stat().st_size
    if size == 0:
        raise ConfigError("data.source", f"'{path}' is empty; give a file with at least {need} tokens "
                          f"(train.seq_len + 2)")
    if size < _SMALL_FILE_BYTES:
        from ..data import load_tokens

        count = load_tokens(cfg.data.source, cfg.model.vocab, cfg.train.seed).numel()
        if count < need:
            raise ConfigError("data.source", f"'{path}' holds {count} tokens, fewer than train.seq_len + 2 = "
                              f"{need}; give more data or a smaller --seq-len")


def warnings_for(cfg: Config) -> list[str]:
    """Settings that run but probably not as meant; printed once, by the process that starts the job."""
    from ..config.nil_effects import nil_effect_warnings

    found = nil_effect_warnings(cfg) + _dropout_warnings(cfg) + _context_warnings(cfg) + _pair_warnings(cfg)
    c = cfg.compress
    if c.method == "dgc" and cfg.train.optimizer == "adamw" and c.dgc_momentum_correction:
        found.append("compress.method=dgc with train.optimizer=adamw: DGC's momentum correction "
                     "(compress.dgc_momentum_correction) assumes momentum SGD; set train.optimizer=sgd (with a larger "
                     "train.lr, e.g. 0.1-0.5), or compress.dgc_momentum_correction=false")
    return found


def _pair_warnings(cfg: Config) -> list[str]:
    """A paired schedule (dualpipev) with ep > 1 under a setting that keeps its pairs sequential."""
    from ..schedules.registry import kind, pair_overlap_blockers

    p = cfg.parallel
    if p.pp == 1 or p.ep == 1 or kind(cfg.pipeline.schedule).pairs is None:
        return []
    # before the device is known `auto` is not settled: only a chosen compile is named
    blockers = pair_overlap_blockers(p.tp, p.zero, cfg.remat.policy, cfg.train.compile is True)
    if not blockers:
        return []
    return [f"pipeline.schedule={cfg.pipeline.schedule}: with {', '.join(blockers)} each pair's forward and backward "
            "run one after the other, so the expert all-to-alls are not hidden behind the other side's "
            "computation (that needs parallel.tp=1, parallel.zero below 3, remat.policy=none, no compile)"]


def _dropout_warnings(cfg: Config) -> list[str]:
    if not cfg.model.preset.startswith("hf:"):
        return []
    from ..config.hf import dropout_asked, read_config_json

    asked = dropout_asked(read_config_json(Path(cfg.model.preset[3:])))
    if not asked:
        return []
    listed = ", ".join(f"{k}={v}" for k, v in asked.items())
    return [f"model.preset: config.json asks for dropout ({listed}); threefold trains without dropout, and "
            "`ckpt export --hf` writes 0 for these keys"]


def _context_warnings(cfg: Config) -> list[str]:
    if not cfg.model.preset.startswith("hf:"):
        return []
    from ..config.hf import model_fields, read_config_json

    directory = Path(cfg.model.preset[3:])
    trained = model_fields(directory)["max_seq"]
    if cfg.model.max_seq <= trained:
        return []
    scaling = read_config_json(directory).get("rope_scaling")
    how = (f"config.json's rope_scaling ({scaling.get('rope_type') or scaling.get('type')}) applies" if scaling else
           "positions past it are new to the model; consider a rope_scaling entry in config.json")
    return [f"model.max_seq: {cfg.model.max_seq} exceeds the {trained} positions the model was trained for "
            f"(max_position_embeddings); {how}"]


def print_warnings(cfg: Config) -> None:
    import sys

    for text in warnings_for(cfg):
        print(f"threefold: warning: {text}", file=sys.stderr, flush=True)
