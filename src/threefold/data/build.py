"""The run's samplers from the [data] config: training, and validation where there is a held-out split.

`data.pack`: packed rows of whole documents (`PackedSampler` over `PackedEpochs`), from prepared
directories only (their index records every document's end; config/checks.py refuses the rest)."""

from __future__ import annotations

from typing import Protocol

from .sampler import PackedSampler, Sampler


class DataChoice(Protocol):
    """What is read here of the [data] section (the config's DataConfig): the data, and packed rows or not."""

    source: str
    sources: str
    pack: bool


def build_samplers(data: DataChoice, seq_len: int, global_batch: int, seed: int, vocab: int,
                   validation: bool = False) -> tuple[Sampler, Sampler | None]:
    """(training sampler, validation sampler when `validation` asks for one, else None)."""
    from .prepared import is_prepared, mixture_of

    mixture = mixture_of(data.sources) if data.sources else []
    if not mixture and is_prepared(data.source):
        mixture = [(data.source, 1.0)]
    if not mixture:
        if data.pack:  # config/checks.py refuses it first
            from ..errors import ConfigError

            raise ConfigError("data.pack", f"needs prepared data (document boundaries), not '{data.source}'")
        from .sources import load_tokens

        return Sampler(load_tokens(data.source, vocab, seed), seq_len, global_batch, seed), None
    return (_prepared(mixture, "train", seq_len, global_batch, seed, vocab, data.pack),
            _prepared(mixture, "val", seq_len, global_batch, seed, vocab, data.pack) if validation else None)


def _prepared(mixture: list[tuple[str, float]], split: str, seq_len: int, global_batch: int, seed: int,
              vocab: int, pack: bool) -> Sampler:
    """Windows of the mixture's prepared splits (`EpochSampler`), or packed rows of their whole documents
    (`PackedEpochs`, `PackedSampler`) with `pack`."""
    from .epochs import EpochSampler, Mixture, PackedEpochs
    from .prepared import open_split

    epochs = PackedEpochs if pack else EpochSampler
    sources = [epochs(open_split(path, split, vocab), seq_len, seed, salt=i) for i, (path, _) in enumerate(mixture)]
    source = sources[0] if len(sources) == 1 else Mixture(sources, [w for _, w in mixture], seed)
    return PackedSampler(source, seq_len, global_batch) if pack else Sampler.from_source(source, seq_len, global_batch)
