"""Local SGD, DiLoCo and EASGD (train.sync_every...) against a plain PyTorch loop of each algorithm
(tests/local_sgd_tasks.py: replicas as model copies with their own AdamW), and the bytes they save."""

from tests.helpers import rel_err
from tests.local_sgd_tasks import reference_run, train_runs

BASE = ["model.preset=tiny", "train.global_batch=8", "train.seq_len=16", "train.steps=6", "train.lr=2e-3",
        "train.eps=1e-6", "train.grad_clip=0.5", "train.warmup_steps=2"]
RUNS = {
    "local SGD H=3": ["train.sync_every=3"],
    "DiLoCo H=3": ["train.sync_every=3", "train.outer_optimizer=nesterov", "train.outer_lr=0.7"],
    "EASGD tau=2 after 2 synchronous steps": ["train.sync_every=2", "train.easgd_alpha=0.2",
                                              "train.sync_warmup_steps=2"],
    "local SGD H=2, moments averaged": ["train.sync_every=2", "train.sync_optimizer_state=true"],
}
TOL = 1e-5


def model_bytes(comm_rows: list[dict], axis: str) -> list[int]:
    """Per step: the bytes of untagged ops (the model's traffic) over `axis`."""
    return [sum(n for op, n in row.get(axis, {}).items() if "." not in op) for row in comm_rows]


def check_against_reference(name: str, results: list[dict], ref: dict) -> str:
    loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
    norm = max(abs(a - b) / abs(b) for a, b in zip(results[0]["norms"], ref["norms"], strict=True))
    param, worst = max((rel_err(r["params"][k], v), k) for r in results for k, v in ref["params"][r["replica"]].items())
    line = f"{name}: loss {loss:.1e} grad norm {norm:.1e} params {param:.1e} ({worst})"
    assert loss <= TOL and norm <= TOL and param <= TOL, line
    return line


def test_periodic_runs_match_a_plain_pytorch_loop_and_send_H_times_less(worlds, tmp_path, capsys):
    runs = [(BASE, str(tmp_path / "dense"))] + [(BASE + extra, str(tmp_path / f"run{i}"))
                                                 for i, extra in enumerate(RUNS.values())]
    per_rank = worlds(2).run(train_runs, runs)
    lines = []
    for i, (name, extra) in enumerate(RUNS.items(), 1):
        lines.append(check_against_reference(name, [r[i] for r in per_rank], reference_run(BASE + extra, 2)))
    # the replicas really diverged between syncs (EASGD never makes them equal)
    easgd = [r[3]["params"] for r in per_rank]
    assert any((easgd[0][k] != easgd[1][k]).any() for k in easgd[0])
    dense, local, diloco = (model_bytes(per_rank[0][i]["comm"], "dp") for i in (0, 1, 2))
    assert len(set(dense)) == 1 and dense[0] > 0
    for got in (local, diloco):  # H=3: nothing on steps 1, 2, 4, 5; one step's worth at 3 and 6
        assert got == [0, 0, dense[0], 0, 0, dense[0]], got
    assert sum(dense) == 3 * sum(diloco)
    with capsys.disabled():
        print(f"\nagainst the plain PyTorch loop, dp=2:\n  " + "\n  ".join(lines) +
              f"\n  dp bytes per 6 steps: dense {sum(dense)}, H=3 {sum(diloco)}")


def test_node_replicas_meet_over_dp_inter_only_at_syncs(worlds, tmp_path):
    """Two nodes of two processes: gradients summed in the node every step, DiLoCo across nodes every 2 steps."""
    nodes = BASE + ["compress.hierarchical=true"]
    diloco = ["train.sync_every=2", "train.outer_optimizer=nesterov"]
    per_rank = worlds(4).run(train_runs, [(nodes, str(tmp_path / "dense")), (nodes + diloco, str(tmp_path / "dl"))],
                             local_world_size=2)
    check_against_reference("DiLoCo over 2 nodes", [r[1] for r in per_rank], reference_run(BASE + diloco, 2))
    leader_dense = model_bytes(per_rank[0][0]["comm"], "dp_inter")
    assert len(set(leader_dense)) == 1 and leader_dense[0] > 0
    for r in per_rank:
        inter = model_bytes(r[1]["comm"], "dp_inter")
        assert inter[0::2] == [0, 0, 0], f"rank {r['rank']} crossed dp_inter between syncs: {inter}"
        assert inter[1::2] == [leader_dense[0] if r[1]["leader"] else 0] * 3, inter  # the node's leader averages
        assert model_bytes(r[1]["comm"], "dp") == [0] * 6
    assert sum(leader_dense) == 2 * sum(model_bytes(per_rank[0][1]["comm"], "dp_inter"))


def test_resume_between_syncs_is_bitwise(worlds, tmp_path):
    diloco = BASE + ["train.steps=5", "train.sync_every=2", "train.outer_optimizer=nesterov",
                     "checkpoint.save_every=3"]
    first = worlds(2).run(train_runs, [(diloco, str(tmp_path / "a"))])
    middle = tmp_path / "a" / "checkpoints" / "step-00000003"  # between the syncs of steps 2 and 4
    resumed = worlds(2).run(train_runs, [(diloco + [f"checkpoint.resume={middle}"], str(tmp_path / "b"))])
    for a, b in zip(first, resumed):
        assert a[0]["losses"][3:] == b[0]["losses"], (a[0]["losses"], b[0]["losses"])
        for k, v in a[0]["params"].items():
            assert (b[0]["params"][k] == v).all(), f"rank {a[0]['rank']}: {k} differs after resuming at step 3"


def test_resume_between_syncs_under_another_dp_matches_the_plain_loop(worlds, tmp_path, capsys):
    """DiLoCo H=4 saved at dp=4 after step 2 (between syncs), resumed at dp=2: each replica restarts from
    replica 0's parameters and moments with the outer state kept, as the plain loop does."""
    diloco = BASE + ["train.sync_every=4", "train.outer_optimizer=nesterov", "checkpoint.save_every=2"]
    first = worlds(4).run(train_runs, [(diloco, str(tmp_path / "a"))])
    middle = tmp_path / "a" / "checkpoints" / "step-00000002"
    resumed = worlds(2).run(train_runs, [(diloco + [f"checkpoint.resume={middle}"], str(tmp_path / "b"))])
    check_against_reference("dp=4", [r[0] for r in first], reference_run(diloco, 4))
    ref = reference_run(diloco, 4, resume_at=2, resumed_replicas=2)
    ref["losses"], ref["norms"] = ref["losses"][2:], ref["norms"][2:]
    line = check_against_reference("resumed at step 2 under dp=2", [r[0] for r in resumed], ref)
    with capsys.disabled():
        print(f"\n  {line}")
