"""`model.loss_chunk`: the head and loss in checkpointed pieces train as the whole-logits loss does
(relative 1e-5 per parameter after 3 steps) where the pieces meet other strategies: vocabulary-
parallel head and loss under tp with sequence parallelism (pieces of whole rows), the last
pipeline stage under zb-h1 (input and weight gradients in separate backward passes), plain dp
(pieces along the sequence). The loss against F.cross_entropy itself: tests/unit/test_model.py."""

from tests.helpers import max_rel_err, train_and_report

BASE = ["model.preset=tiny-llama", "train.global_batch=4", "train.seq_len=16", "train.steps=3"]
LAYOUTS = {"dp-sequence": (["parallel.dp=2"], 8),
           "tp-sp-rows": (["parallel.tp=2", "parallel.sequence_parallel=true", "train.microbatches=2"], 8),
           "pp-zb-h1": (["model.layers=4", "parallel.pp=2", "train.microbatches=2", "pipeline.schedule=zb-h1"], 8)}


def whole_and_pieces(out: str) -> dict:
    found = {}
    for name, (overrides, chunk) in LAYOUTS.items():
        whole = train_and_report(BASE + overrides, f"{out}/{name}-whole")
        pieces = train_and_report(BASE + overrides + [f"model.loss_chunk={chunk}"], f"{out}/{name}-pieces")
        found[name] = (whole["losses"], pieces["losses"], max_rel_err(pieces["params"], whole["params"]))
    return found


def test_loss_in_pieces_trains_as_the_whole_loss(worlds, tmp_path):
    for rank, found in enumerate(worlds(2).run(whole_and_pieces, str(tmp_path))):
        for name, (whole, pieces, (err, where)) in found.items():
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(pieces, whole)), (rank, name, pieces, whole)
            assert err <= 1e-5, f"rank {rank}, {name}: {where} differs by {err:.2e}"
