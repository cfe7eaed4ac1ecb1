"""Epochs over a prepared split, and weighted mixtures of them: global sample index -> token ids.

Epoch e of a split is its documents in a shuffled order, concatenated (each ends with the
end-of-text id) and cut into sequences of seq_len + 1 tokens that overlap by one token, so
every token of the epoch is a target exactly once (the tail shorter than a sequence is left
out). The sequences of the epoch are read in a second shuffled order. Both orders sort
splitmix64 keys of (seed, epoch, index): a pure function, the same on every machine. Sample
g is sequence g mod S of epoch g div S, with S sequences per epoch.

A mixture interleaves sources by weight in blocks of BLOCK samples: each source gets a fixed
number of slots per block (largest remainders of weight x BLOCK), the slots are shuffled by
(seed, block), and the n-th slot of source i draws that source's next sample. Which sample of
which source sample g is stays a pure function of (seed, g): runs resume and reshard exactly.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from ..errors import UserError
from .packing import Packed, pack_documents
from .prepared import Documents

BLOCK = 1000
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element (uint64, wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64) + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def shuffled(n: int, *key: int) -> np.ndarray:
    """A permutation of range(n), a pure function of `key`."""
    salt = np.uint64(0)
    for k in key:
        salt = mix64(np.array([int(salt) ^ (k & ((1 << 64) - 1))], dtype=np.uint64))[0]
    keys = mix64(np.arange(n, dtype=np.uint64) ^ salt)
    return np.argsort(keys, kind="stable")


class EpochSampler:
    """Sequences of seq_len + 1 tokens read from a split in epochs (see the module docstring)."""

    def __init__(self, docs: Documents, seq_len: int, seed: int, salt: int = 0):
        self.docs, self.seq_len, self.seed, self.salt = docs, seq_len, seed, salt
        self.per_epoch = (docs.tokens - 1) // seq_len
        if self.per_epoch < 1:
            raise UserError(f"data: '{docs.directory}' holds {docs.tokens} tokens, fewer than train.seq_len + 1 = "
                            f"{seq_len + 1}; prepare more text or shorten train.seq_len")
        self._epoch = lru_cache(maxsize=2)(self._orders)

    def _orders(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        order = shuffled(self.docs.lengths.size, self.seed, self.salt, epoch, 0)
        ends = np.cumsum(self.docs.lengths[order])
        sequences = shuffled(self.per_epoch, self.seed, self.salt, epoch, 1)
        return order, ends, sequences

    def state(self, samples: int) -> dict:
        """Where the reader stands after `samples` samples: epoch and sequences of it already read."""
        epoch, position = divmod(samples, self.per_epoch)
        return {"epoch": epoch, "position": position, "sequences_per_epoch": self.per_epoch}

    def sample(self, g: int) -> np.ndarray:
        epoch, p = divmod(g, self.per_epoch)
        order, ends, sequences = self._epoch(epoch)
        first = int(sequences[p]) * self.seq_len
        need, pieces = self.seq_len + 1, []
        k = int(np.searchsorted(ends, first, side="right"))
        offset = first - (int(ends[k - 1]) if k else 0)
        while need:
            doc = int(order[k])
            piece = self.docs.tokens_of(doc, offset, min(need, int(self.docs.lengths[doc]) - offset))
            pieces.append(piece)
            need -= piece.size
            k, offset = k + 1, 0
        return np.concatenate(pieces).astype(np.int64)


class PackedEpochs:
    """Rows of seq_len + 1 tokens of whole documents, read from a split in epochs (module docstring)."""

    def __init__(self, docs: Documents, seq_len: int, seed: int, salt: int = 0):
        self.docs, self.seq_len, self.seed, self.salt = docs, seq_len, seed, salt
        self.length = seq_len + 1
        self.pad_id = docs.tokenizer.eot_id  # any id: padding is masked from attention and from the loss
        if docs.tokens < 2:
            raise UserError(f"data: '{docs.directory}' holds {docs.tokens} tokens; prepare more text")
        self._starts = [0]  # the first global row of every epoch packed so far (and of the next)
        self._lock = threading.Lock()  # the loader's thread reads rows while a checkpoint asks the state
        self._epoch = lru_cache(maxsize=2)(self._plan)

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(document, offset and length of every piece in packing order, each row's first piece (rows + 1
        of them), the rows' reading order) of `epoch`."""
        order = shuffled(self.docs.lengths.size, self.seed, self.salt, epoch, 0)
        lengths, n = self.docs.lengths[order], self.length
        counts = -(-lengths // n)  # pieces per document: one longer than a row is cut into rows
        doc = np.repeat(order, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        offset = (np.arange(doc.size) - first) * n
        size = np.minimum(np.repeat(lengths, counts) - offset, n)
        starts, used = [], n  # pack_documents' rule: a piece that does not fit starts the next row
        for i, piece in enumerate(size.tolist()):
            if used + piece > n:
                starts.append(i)
                used = 0
            used += piece
        starts.append(doc.size)
        rows = shuffled(len(starts) - 1, self.seed, self.salt, epoch, 1)
        return doc, offset, size, np.asarray(starts, dtype=np.int64), rows

    def _locate(self, g: int) -> tuple[int, int]:
        """(epoch, row of it) of global row g, packing the epochs before it as needed."""
        with self._lock:
            while self._starts[-1] <= g:
                epoch = len(self._starts) - 1
                self._starts.append(self._starts[-1] + self._epoch(epoch)[3].size - 1)
            epoch = int(np.searchsorted(self._starts, g, side="right")) - 1
        return epoch, g - self._starts[epoch]

    def state(self, samples: int) -> dict:
        """Where the reader stands after `samples` rows: epoch, rows of it already read, its rows."""
        epoch, position = self._locate(samples)
        return {"epoch": epoch, "position": position, "rows_in_epoch": self._starts[epoch + 1] - self._starts[epoch]}

    def row(self, g: int) -> Packed:
        epoch, p = self._locate(g)
        doc, offset, size, starts, rows = self._epoch(epoch)
        r = int(rows[p])
        pieces = [self.docs.tokens_of(int(d), int(o), int(c))
                  for d, o, c in zip(doc[starts[r]:starts[r + 1]], offset[starts[r]:starts[r + 1]],
                                     size[starts[r]:starts[r + 1]])]
        packed = pack_documents(pieces, self.length, self.pad_id)
        assert packed.tokens.shape[0] == 1, "a planned row packs into one row"
        return packed


class Mixture:
    """Weighted interleaving of several samplers (see the module docstring)."""

    def __init__(self, sources: list[EpochSampler] | list[PackedEpochs], weights: list[float], seed: int):
        self.sources, self.seed = sources, seed
        total = sum(weights)
        quotas = [w / total * BLOCK for w in weights]
        counts = [int(q) for q in quotas]
        for i in sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))[: BLOCK - sum(counts)]:
            counts[i] += 1
        if min(counts) == 0:
            raise UserError(f"data.sources: weight {min(weights)} gets no sample in {BLOCK}; raise it")
        self.counts = counts
        self.labels = np.repeat(np.arange(len(counts)), counts)
        self._block = lru_cache(maxsize=4)(self._slots)

    def _slots(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, index of the slot among its source's slots) of `block`."""
        labels = self.labels[shuffled(BLOCK, self.seed, block, 2)]
        rank = np.zeros(BLOCK, dtype=np.int64)
        for i in range(len(self.counts)):
            where = labels == i
            rank[where] = np.arange(int(where.sum()))
        return labels, rank

    def locate(self, g: int) -> tuple[int, int]:
        """(source, that source's sample index) of mixture sample g."""
        block, slot = divmod(g, BLOCK)
        labels, rank = self._block(block)
        source = int(labels[slot])
        return source, block * self.counts[source] + int(rank[slot])

    def sample(self, g: int) -> np.ndarray:
        source, n = self.locate(g)
        return self.sources[source].sample(n)

    def row(self, g: int) -> Packed:
        """Mixture sample g of packed sources (`PackedEpochs`)."""
        source, n = self.locate(g)
        return self.sources[source].row(n)

    def drawn(self, samples: int) -> list[int]:
        """How many samples each source gave to the first `samples` of the mixture."""
        block, slot = divmod(samples, BLOCK)
        labels, _ = self._block(block)
        return [block * c + int((labels[:slot] == i).sum()) for i, c in enumerate(self.counts)]

    def state(self, samples: int) -> dict:
        return {"sources": [s.state(n) for s, n in zip(self.sources, self.drawn(samples))]}
