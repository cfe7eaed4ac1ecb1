"""The run's samplers from the [data] config: training, and validation where there is a held-out split.

`data.pack`: packed rows of whole documents (`PackedSampler` over `PackedEpochs`), from prepared
directories only (their index records every document's end; config/checks.py refuses the rest)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sampler import PackedSampler, Sampler

if TYPE_CHECKING:
    from ..config import DataConfig


def build_samplers(data: "DataConfig", seq_len: int, global_batch: int, seed: int, vocab: int,
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
    if data.pack:
        return (_packed(mixture, "train", seq_len, global_batch, seed, vocab),
                _packed(mixture, "val", seq_len, global_batch, seed, vocab) if validation else None)
    return (_prepared(mixture, "train", seq_len, global_batch, seed, vocab),
            _prepared(mixture, "val", seq_len, global_batch, seed, vocab) if validation else None)


def _prepared(mixture: list[tuple[str, float]], split: str, seq_len: int, global_batch: int, seed: int,
              vocab: int) -> Sampler:
    from .epochs import EpochSampler, Mixture
    from .prepared import open_split

    samplers = [EpochSampler(open_split(path, split, vocab), seq_len, seed, salt=i) for i, (path, _) in enumerate(mixture)]
    if len(samplers) == 1:
        return Sampler.from_source(samplers[0], seq_len, global_batch)
    return Sampler.from_source(Mixture(samplers, [w for _, w in mixture], seed), seq_len, global_batch)


def _packed(mixture: list[tuple[str, float]], split: str, seq_len: int, global_batch: int, seed: int,
            vocab: int) -> PackedSampler:
    from .epochs import Mixture, PackedEpochs
    from .prepared import open_split

    sources = [PackedEpochs(open_split(path, split, vocab), seq_len, seed, salt=i) for i, (path, _) in enumerate(mixture)]
    if len(sources) == 1:
        return PackedSampler(sources[0], seq_len, global_batch)
    return PackedSampler(Mixture(sources, [w for _, w in mixture], seed), seq_len, global_batch)
