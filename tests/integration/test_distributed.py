import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from topocallbacks.distributed import broadcast_object, gather_probe_features, shard
from topocallbacks.sinks import JsonlSink

HERE = Path(__file__).parent


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
def test_probe_features_are_gathered_in_order_without_padding_duplicates(tmp_path, n):
    mp.spawn(_gather_worker, args=(2, str(tmp_path / "init"), n, str(tmp_path)), nprocs=2, join=True)
    expected = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    for rank in (0, 1):
        np.testing.assert_array_equal(np.load(tmp_path / f"gathered{rank}.npy"), expected)
        meta = json.loads((tmp_path / f"meta{rank}.json").read_text())
        assert meta["calls"] == [shard(n, rank, 2) or [0]]  # each rank ran only its shard
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, str(HERE / "ddp_fit.py"), str(tmp_path), "stop", "33", mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
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
    assert Path(tmp_path, f"topo-stop-step{stop['step']}.ckpt").exists()
    # Only rank 0 writes the history file: one line per check and per intervention, none twice.
    assert JsonlSink.read(tmp_path / "history.jsonl") == ranks[0]["history"]
    assert (
        torch.load(Path(tmp_path, f"topo-stop-step{stop['step']}.ckpt"), weights_only=False)["global_step"]
        == stop["step"]
    )
