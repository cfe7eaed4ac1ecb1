"""The step's work around forward and backward is a fixed number of operations, not some per tensor
(issue: GPT-2's 184 tensors made about 550 kernels a step): the fp32 gradient copies and their
unscaling, the copies of the updated masters into the model and the zeroing of the gradient buffers
are multi-tensor or one flat buffer. Counted on CPU with the CUDA path's fused optimizer switched on,
as every operation a dispatch mode sees that is not a view (views launch nothing)."""

from tests.helpers import make_config

BASE = ["model.preset=tiny", "train.global_batch=4", "train.seq_len=16", "train.steps=3", "train.microbatches=1",
        "data.prefetch=0"]
LAYOUTS = {"dp-bf16": ["parallel.dp=2", "precision.compute=bf16"],
           "zero1-bf16": ["parallel.dp=2", "parallel.zero=1", "precision.compute=bf16"],
           "dp-fp16": ["parallel.dp=2", "precision.compute=fp16"],
           "dp-fp32": ["parallel.dp=2"]}


def count_ops(out: str) -> dict:
    """{layout: {layers: (operations outside forward/backward in one step, parameter tensors)}}."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import threefold.parallel.master as master
    from threefold.train.trainer import Trainer

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.on, self.ops = True, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.on and not func.is_view:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    fused_on, master.fused_on = master.fused_on, lambda device: True  # the CUDA path's optimizer
    found = {}
    try:
        for name, overrides in LAYOUTS.items():
            for layers in (1, 4):
                trainer = Trainer(make_config(BASE + overrides + [f"model.layers={layers}"], f"{out}/{name}-{layers}"))
                trainer.train_one_step()
                step = trainer.step + 1
                micro_batches, _ = trainer.loader.get(step - 1)
                counter = Count()
                inner = trainer.parallel.forward_backward

                def forward_backward(*args, inner=inner, counter=counter):
                    counter.on = False
                    try:
                        return inner(*args)
                    finally:
                        counter.on = True

                trainer.parallel.forward_backward = forward_backward
                with counter:
                    trainer.step_fn(step, micro_batches, trainer.global_tokens)
                    trainer.memory()
                trainer.loader.close()
                found.setdefault(name, {})[layers] = (len(counter.ops), len(list(trainer.parallel.module.parameters())))
    finally:
        master.fused_on = fused_on
    return found


def test_the_steps_operations_do_not_grow_with_the_tensor_count(worlds, tmp_path):
    for rank, found in enumerate(worlds(2).run(count_ops, str(tmp_path))):
        for name, by_layers in found.items():
            (few, tensors_few), (many, tensors_many) = by_layers[1], by_layers[4]
            assert tensors_many > tensors_few + 10, by_layers
            assert many == few, f"rank {rank}, {name}: {few} operations with {tensors_few} tensors, " \
                                f"{many} with {tensors_many}"
