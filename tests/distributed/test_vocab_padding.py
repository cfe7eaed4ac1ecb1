"""`model.vocab_multiple` under tp=2, the padding in the last shard (vocabulary 200 padded to 256:
rank 1 holds ids 128..255, of which 200..255 are padding): one forward + backward equals the
unpadded single-process model's (loss and the real rows' gradients within 1e-6, the padded rows'
gradients zero), and a trained checkpoint exports to Hugging Face with only the real rows, whose
logits from transformers' from_pretrained are threefold's."""

import torch

from tests.helpers import rel_err

PADDED = ["model.vocab=200", "model.vocab_multiple=128"]


def one_pass(presets: list[str]) -> dict:
    import torch.distributed as dist

    from threefold.comm import Comm
    from threefold.config import load_config
    from threefold.mesh import Layout, Mesh
    from threefold.models.decoder import build_model
    from threefold.models.decoder_plan import decoder_plan
    from threefold.parallel.tensor import gather_full, gather_vocab
    from threefold.parallel.tensor_plan import parallelize_tensor

    mesh = Mesh(Layout(tp=dist.get_world_size()), torch.device("cpu"))
    comm = Comm(mesh)
    found = {}
    for preset in presets:
        cfg = load_config(None, [f"model.preset={preset}", *PADDED]).model
        plain = build_model(load_config(None, [f"model.preset={preset}", "model.vocab=200"]).model, 0)
        model = build_model(cfg, 0)
        placements = parallelize_tensor(model, mesh, comm, decoder_plan(cfg), False)
        tokens, targets = torch.randint(0, 200, (2, 2, 16), generator=torch.Generator().manual_seed(3))
        ref = plain(tokens, targets)
        ref.backward()
        loss = model(tokens, targets)
        loss.backward()
        logits = gather_vocab(model(tokens), comm, cfg.vocab).detach()
        grads = gather_full({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, placements, comm)
        found[preset] = {"loss": rel_err(loss.detach(), ref.detach()), "logits": rel_err(logits, plain(tokens).detach()),
                         "grads": {n: (rel_err(grads[n][:p.shape[0]], p.grad), grads[n][p.shape[0]:].abs().sum().item(),
                                       tuple(grads[n].shape))
                                   for n, p in plain.named_parameters() if p.grad is not None}}
    return found


def test_padded_vocabulary_under_tp_equals_unpadded_and_exports_real_rows(worlds, tmp_path):
    import transformers

    from tests.hf_tasks import train_with_logits
    from threefold.checkpoint.hf import export_hf

    world = worlds(2)
    for rank, found in enumerate(world.run(one_pass, ["tiny", "tiny-llama"])):
        for preset, f in found.items():
            assert f["loss"] < 1e-6 and f["logits"] < 1e-6, (rank, preset, f["loss"], f["logits"])
            for name, (err, pad, shape) in f["grads"].items():
                assert err < 1e-6 and pad == 0.0, (rank, preset, name, err, pad)
            assert f["grads"]["embed.tok.weight"][2] == (256, 32), f["grads"]["embed.tok.weight"]
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(7))
    quick = ["train.global_batch=4", "train.seq_len=16", "train.steps=2", "checkpoint.save_every=2", "parallel.tp=2",
             *PADDED]
    runs = {"llama": ["model.preset=tiny-llama"], "gpt2": ["model.preset=tiny"]}
    results = world.run(train_with_logits, [(o + quick, str(tmp_path / f)) for f, o in runs.items()], tokens)
    for i, family in enumerate(runs):
        export_hf(tmp_path / family, tmp_path / f"{family}-hf")
        library = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{family}-hf"))
        assert library.get_input_embeddings().weight.shape == (200, 32), family  # only the real rows
        with torch.no_grad():
            logits = library(input_ids=tokens).logits
        ours = [r[i]["after"] for r in results]
        assert all(t.shape == (2, 24, 200) for t in ours), family
        errors = [rel_err(logits, t) for t in ours]
        assert max(errors) <= 1e-5, f"{family}: logits differ by {errors}"
