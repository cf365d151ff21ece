"""Rollback under sharding, on CPU: FSDP2 and FSDP1 in a plain loop (torchrun, gloo, 2 ranks), and Lightning's
ModelParallelStrategy (FSDP2 in ``configure_model``).

The scripts collapse the watched layer at known steps, so the rule rolls back at known checks; each rank records a
hash of its own shards and of the gathered state at every step, which is how "bit for bit" is checked.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.ranks import ENV, finished, run_two_ranks
from tests.waiting import HANG_SECONDS

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def interventions(rank):
    return [(r["step"], r["action"]) for r in rank["history"] if r["kind"] == "intervention"]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "mode"), [("fsdp2", "plain"), ("fsdp1", "plain"), ("fsdp2", "disk")])
def test_sharded_rollback_restores_every_rank_bit_for_bit_with_the_skip_and_the_compounding_cut(tmp_path, kind, mode):
    # mode "disk": the snapshots are files (`snapshot_dir`), each rank's shard its own file.
    ranks, _ = run_two_ranks("fsdp_rollback.py", tmp_path, kind, mode, torchrun=True)
    for rank in ranks:
        assert interventions(rank) == [(15, "rollback"), (25, "rollback")]
        local, full, lr = rank["local"], rank["full"], rank["lr"]
        # Sharded for real: each rank holds half of the state.
        assert rank["local_numel"]["0"] * 2 == rank["full_numel"]
        # After each rollback, this rank's shards and the gathered state are the snapshot's, bit for bit: the
        # parameters, the optimizer's moments and its step counters.
        assert local["15"] == local["10"]
        assert full["15"] == full["10"]
        assert local["25"] == local["20"]
        assert full["25"] == full["20"]
        assert rank["steps"]["15"] == rank["steps"]["10"] == [10.0]
        assert len({local["12"], local["14"]}) == 2  # the state did move in between
        # The skip: the 3 updates after each rollback leave the weights alone; the next one moves them.
        assert len({local[str(s)] for s in range(15, 19)}) == 1
        assert local["19"] != local["18"]
        assert len({local[str(s)] for s in range(25, 29)}) == 1
        assert local["29"] != local["28"]
        # The cut: the snapshot's rate x 0.5 at the first rollback; the second goes back to a snapshot that holds
        # the first cut already and cuts once more (x 0.25 of the uncut schedule).
        assert lr["15"] == lr["10"] * 0.5
        assert lr["25"] == lr["20"] * 0.5
        assert lr["25"] == pytest.approx(3e-3 / (1 + 0.05 * 15) * 0.25, rel=1e-12)
    if mode == "disk":  # the two newest (steps 20 and 30), a file per rank, no half-written one left
        names = [f"topo-snapshot-step{s}{r}.pt" for s in (20, 30) for r in ("-rank1", "")]
        assert ranks[0]["files"] == names
    assert ranks[0]["history"] == ranks[1]["history"]
    assert ranks[0]["full"] == ranks[1]["full"]  # the ranks hold one model between them
    assert ranks[0]["local"]["10"] != ranks[1]["local"]["10"]  # in different shards


@pytest.mark.slow
def test_a_snapshot_one_rank_failed_to_copy_is_skipped_by_every_rank(tmp_path):
    # Rank 1 cannot copy its shard at step 20 (an injected MemoryError): training goes on, and the rollback at 25
    # goes back to step 10 on both ranks (the newest snapshot both hold), never to 20 on rank 0 alone.
    ranks, _ = run_two_ranks("fsdp_rollback.py", tmp_path, "fsdp2", "fail", torchrun=True)
    assert ranks[0]["warnings"] == []
    assert [w[:62] for w in ranks[1]["warnings"]] == ["topocallbacks could not keep the snapshot of step 20 on rank 1"]
    assert "(MemoryError: injected: no room for this copy)" in ranks[1]["warnings"][0]
    for rank in ranks:
        assert interventions(rank) == [(15, "rollback"), (25, "rollback")]
        rollback = [r for r in rank["history"] if r["kind"] == "intervention"][1]
        assert rollback["detail"].startswith("rolled back to the snapshot of step 10")
        assert rank["local"]["25"] == rank["local"]["10"]
        assert rank["full"]["25"] == rank["full"]["10"]
        assert rank["lr"]["25"] == rank["lr"]["10"] * 0.25  # both rollbacks' cuts, relative to step 10's rate
    assert ranks[0]["full"] == ranks[1]["full"]


@pytest.mark.slow
def test_lightning_model_parallel_strategy_rolls_back_every_rank_bit_for_bit(tmp_path):
    # Lightning's ModelParallelStrategy on CPU (FSDP2 in configure_model): the snapshot and restore go through the
    # strategy's module, each rank its own shard.
    ranks, _ = run_two_ranks("lightning_sharded_rollback.py", tmp_path)
    for rank in ranks:
        assert interventions(rank) == [(15, "rollback")]
        local, full = rank["local"], rank["full"]
        assert local["15"] == local["10"]
        assert full["15"] == full["10"]
        assert rank["steps"]["15"] == rank["steps"]["10"] == [10.0]
        assert len({local[str(s)] for s in range(15, 19)}) == 1
        assert local["19"] != local["18"]
        assert rank["lr"]["15"] == rank["lr"]["10"] * 0.5
    assert ranks[0]["history"] == ranks[1]["history"]
    assert ranks[0]["full"] == ranks[1]["full"]
    assert ranks[0]["local"]["10"] != ranks[1]["local"]["10"]
    found = gpu_script().checks(ranks)  # what the GPU script checks on CUDA holds here
    assert all(found.values()), found


@pytest.mark.slow
def test_a_rank_killed_mid_snapshot_ends_the_job_without_a_hang_or_a_restore(tmp_path):
    # torchrun ends the other rank; no rank goes on alone, none restores, and no file of the killed copy is left.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, **ENV}
    script = Path(__file__).parent / "fsdp_rollback.py"
    done = subprocess.run(
        [*launcher, str(script), str(tmp_path), "fsdp2", "kill"],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_SECONDS,
    )
    assert done.returncode != 0
    assert "exitcode  : -9" in done.stdout + done.stderr  # rank 1, killed
    assert not list(tmp_path.glob("rank*.json"))  # no rank trained on to its end
    files = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert "topo-snapshot-step20-rank1.pt" not in files
    assert not [f for f in files if f.endswith(".partial")]


def gpu_script():
    """``benchmarks/gpu_sharded_rollback.py``: the GPU cases' runner and the checks they must pass."""
    spec = importlib.util.spec_from_file_location("gpu_sharded_rollback", BENCHMARKS / "gpu_sharded_rollback.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.slow
def test_the_gpu_scripts_hf_worker_passes_its_checks_with_ddp_on_cpu(tmp_path):
    # benchmarks/gpu_sharded_rollback.py runs its Hugging Face worker under accelerate's FSDP on a GPU; here it runs
    # with DDP on CPU (version "0"), so that the script a GPU machine runs is known to work up to the device.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, **ENV}
    done = subprocess.run(
        [*launcher, str(BENCHMARKS / "gpu_sharded_rollback.py"), "--hf-worker", str(tmp_path), "0"],
        capture_output=True, text=True, env=env, timeout=HANG_SECONDS,
    )  # fmt: skip
    found = gpu_script().checks(finished(done, tmp_path))
    assert all(found.values()), found
