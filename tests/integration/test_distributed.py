import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.integration.ranks import run_two_ranks
from topocallbacks.distributed import broadcast_object, gather_probe_features, shard
from topocallbacks.sinks import JsonlSink


def _gather_worker(rank, world, init_file, n, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        features = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
        calls = []

        def compute(indices):
            calls.append(list(indices))
            return features[list(indices)]

        gathered = gather_probe_features(compute, n)
        decision = broadcast_object({"from": rank, "stop": True} if rank == 0 else None)
        np.save(os.path.join(out, f"gathered{rank}.npy"), gathered)
        Path(out, f"meta{rank}.json").write_text(json.dumps({"calls": calls, "decision": decision}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n", [7, 8, 1])
@pytest.mark.slow
def test_probe_features_are_gathered_in_order_without_padding_duplicates(tmp_path, n):
    mp.spawn(_gather_worker, args=(2, str(tmp_path / "init"), n, str(tmp_path)), nprocs=2, join=True)
    expected = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    for rank in (0, 1):
        np.testing.assert_array_equal(np.load(tmp_path / f"gathered{rank}.npy"), expected)
        meta = json.loads((tmp_path / f"meta{rank}.json").read_text())
        # Each rank ran its shard, padded to the same length (the same forward passes on every rank).
        own = shard(n, rank, 2)
        assert meta["calls"] == [own + [own[-1] if own else 0] * (-(-n // 2) - len(own))]
        assert meta["decision"] == {"from": 0, "stop": True}


def test_outside_distributed_training_everything_runs_locally():
    assert not dist.is_initialized()
    assert gather_probe_features(lambda idx: np.asarray(idx, dtype=np.float32)[:, None], 5).ravel().tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert broadcast_object("x") == "x"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inline", "background"])
def test_two_process_ddp_agrees_on_every_check_and_stops_together(tmp_path, mode):
    ranks, _ = run_two_ranks("ddp_fit.py", tmp_path, "stop", "33", mode)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] < 200  # stopped, together, no hang
    assert ranks[0]["history"] == ranks[1]["history"]  # the same CI and the same decision at every check
    assert ranks[0]["logged_ci"] == ranks[1]["logged_ci"]
    checks = [r for r in ranks[0]["history"] if r["kind"] == "check"]
    assert all(r["n_points"] == 33 for r in checks)  # 17 + 16 probe samples, the padding row dropped
    stop = [r for r in ranks[0]["history"] if r["kind"] == "intervention"][-1]
    assert stop["action"] == "stop"
    assert stop["step"] == ranks[0]["global_step"]
    # Every decision is applied at the step announced with its check: at once inline, 3 steps later in the
    # background (rank 0's worker evaluated it while both ranks trained on).
    lag = 3 if mode == "background" else 0
    assert all(r["applied_step"] == r["step"] + lag for r in checks)
    assert stop["step"] == checks[-1]["step"] + lag
    # Both ranks restored the same healthy snapshot before stopping (the histories are equal).
    assert stop["detail"].startswith(f"restored the last healthy state, the snapshot of step {stop['snapshot_step']} ")
    assert Path(tmp_path, f"topo-stop-step{stop['step']}.ckpt").exists()
    # Only rank 0 writes the history file: one line per check and per intervention, none twice.
    assert JsonlSink.read(tmp_path / "history.jsonl") == ranks[0]["history"]
    assert (
        torch.load(Path(tmp_path, f"topo-stop-step{stop['step']}.ckpt"), weights_only=False)["global_step"]
        == stop["step"]
    )


@pytest.mark.slow
def test_two_process_ddp_follows_rank_zeros_one_plan_on_every_rank(tmp_path):
    # An overhead budget far below what checks every 10 steps cost: rank 0 measures and plans once, at the third
    # check (step 20); the plan travels with that check's record, and both ranks check, apply and warn alike after it.
    ranks, _ = run_two_ranks("ddp_fit.py", tmp_path, "warn", "33", "budget")
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 200
    assert ranks[0]["history"] == ranks[1]["history"]
    checks = [r for r in ranks[0]["history"] if r["kind"] == "check"]
    (plan,) = [r["plan"] for r in checks if r["plan"] is not None]
    assert plan["at_step"] == 20
    later = [r["step"] for r in checks if r["step"] >= 20]
    assert len(later) >= 4
    assert all(b - a == plan["intervals"] * 10 for a, b in itertools.pairwise(later))  # the plan's cadence
    automatic = 5  # half the interval: the lag when the plan leaves it to the settings
    lag = (automatic if plan["lag"] is None else plan["lag"]) if plan["background"] else 0
    assert all(r["applied_step"] == r["step"] + lag for r in checks if r["step"] > 20)
    assert all(r["applied_step"] == r["step"] for r in checks if r["step"] <= 20)  # in the loop until the plan


@pytest.mark.slow
def test_two_process_hf_trainer_agrees_on_every_check_and_cuts_then_stops_together(tmp_path):
    ranks, result = run_two_ranks("hf_ddp_train.py", tmp_path, "lower_lr", torchrun=True)
    assert [rank["world"] for rank in ranks] == [2, 2]
    assert ranks[0]["history"] == ranks[1]["history"]
    actions = [(r["step"], r["action"]) for r in ranks[0]["history"] if r["kind"] == "intervention"]
    assert actions == [(3, "lower_lr"), (6, "lower_lr"), (9, "stop")]  # two cuts, then the escalation
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 9
    for rank in ranks:  # the cut reached the optimizer accelerate wraps, on every rank, at the same step
        rates = {int(step): lr for step, lr in rank["rates"].items()}
        assert [rates[s] for s in (2, 3, 5, 6, 8)] == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.025])
    checks = [r for r in ranks[0]["history"] if r["kind"] == "check"]
    assert all(r["n_points"] == 33 for r in checks)  # 17 + 16 probe samples, the padding dropped
    assert result.stdout.count("topocallbacks: 4 checks") == 1  # one summary, on rank 0
    assert (tmp_path / "checkpoint-9").is_dir()


@pytest.mark.slow
def test_fsdp2_sharded_model_probe_pass_matches_the_unsharded_model_and_cuts_on_every_rank(tmp_path):
    # FSDP needs every rank in every forward: a probe of 33 samples in batches of 8 gives rank 0 17 samples (3
    # passes) and rank 1 16 (2 passes) unless the shards are padded to the same length (a gloo collective
    # mismatch before).
    ranks, _ = run_two_ranks("fsdp_check.py", tmp_path, torchrun=True)
    assert ranks[0]["model"] == "FSDPSequential"
    assert ranks[0]["watched"] == "2"
    assert ranks[0]["history"] == ranks[1]["history"]
    assert all(rank["feature_error"] < 1e-5 for rank in ranks)
    assert ranks[0]["first_ci"] == pytest.approx(ranks[0]["unsharded_ci"], abs=1e-6)
    assert [(r["step"], r["action"]) for r in ranks[0]["history"] if r["kind"] == "intervention"] == [
        (5, "lower_lr"),
        (10, "lower_lr"),
    ]
    assert [rank["lr"] for rank in ranks] == [0.025, 0.025]
