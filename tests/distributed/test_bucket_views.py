"""Gradients land in the buckets one multi-tensor operation per bucket, not one per parameter
(parallel/buckets.py): a whole step - forward, backward, gradient sync, norm, clip, update - counted
with a dispatch mode on a GPT-2-shaped model of 1 and of 4 blocks (20 and 68 parameter tensors). The
operations that move gradients (add_, copy_, clone, zero_, _to_copy) are as many for 68 tensors as
for 20; only the model's own compute grows with its depth. Before, autograd added every gradient
into its bucket view, one add_ per parameter and micro-batch (torch DDP's gradient_as_bucket_view
costs the same), and ZeRO-2 copied each into its pooled buffer, one copy_ each. Counted with the
CUDA path's fused optimizer switched on, as tests/distributed/test_step_ops.py does."""

from tests.helpers import make_config

BASE = ["model.preset=tiny", "train.global_batch=4", "train.seq_len=16", "train.steps=3", "data.prefetch=0",
        "parallel.dp=2"]
LAYOUTS = {"dp-dgc-2mb": ["compress.method=dgc", "train.microbatches=2"],
           "zero1-bf16-2mb": ["parallel.zero=1", "precision.compute=bf16", "train.microbatches=2"],
           "zero2-bf16-2mb": ["parallel.zero=2", "precision.compute=bf16", "train.microbatches=2"]}
GRADIENT_MOVES = ("aten.add_.Tensor", "aten.copy_.default", "aten.clone.default", "aten.zero_.default",
                  "aten._to_copy.default", "aten._foreach_add_.List", "aten._foreach_copy_.default")


def count_step_ops(out: str, layouts: dict) -> dict:
    """{layout: {layers: ({operation: count} over one whole step, parameter tensors)}}."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    import threefold.parallel.master as master
    from threefold.train.trainer import Trainer

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    fused_on, master.fused_on = master.fused_on, lambda device: True  # the CUDA path's optimizer
    found = {}
    try:
        for name, overrides in layouts.items():
            for layers in (1, 4):
                trainer = Trainer(make_config(BASE + overrides + [f"model.layers={layers}"], f"{out}/{name}-{layers}"))
                trainer.train_one_step()
                step = trainer.step + 1
                micro_batches, _ = trainer.loader.get(step - 1)
                with Count() as counter:
                    trainer.step_fn(step, micro_batches, trainer.global_tokens)
                trainer.loader.close()
                found.setdefault(name, {})[layers] = (dict(counter.ops),
                                                      len(list(trainer.parallel.module.parameters())))
    finally:
        master.fused_on = fused_on
    return found


def test_gradients_move_into_the_buckets_in_operations_per_bucket_not_per_parameter(worlds, tmp_path):
    for rank, found in enumerate(worlds(2).run(count_step_ops, str(tmp_path), LAYOUTS)):
        for name, by_layers in found.items():
            (few, tensors_few), (many, tensors_many) = by_layers[1], by_layers[4]
            assert tensors_many > tensors_few + 40, by_layers
            grown = {op: (few.get(op, 0), many.get(op, 0)) for op in GRADIENT_MOVES
                     if few.get(op, 0) != many.get(op, 0)}
            assert not grown, f"rank {rank}, {name}: (count with {tensors_few} tensors, with {tensors_many}) {grown}"
