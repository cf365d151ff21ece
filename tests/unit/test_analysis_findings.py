"""`analyze`'s sentences on checkpoints whose answer is known: a lasting jump, a transient one, none; correlated
quantities, none (issue 39)."""

from topocallbacks.analysis.summaries import findings


def drift_rows(drifts, layer="avgpool"):
    rows = [{"source": "features", "layer": layer, "step": 0, "diagram_drift": None, "effective_rank": 10.0}]
    for i, drift in enumerate(drifts, start=1):
        rows.append({"source": "features", "layer": layer, "step": 50 * i, "diagram_drift": drift,
                     "effective_rank": 10.0})  # fmt: skip
    return rows


def test_a_change_that_lasts_is_found_at_the_checkpoint_where_it_starts():
    # The case: the drift jumps at the 4th checkpoint and stays up; against the median of all checkpoints
    # the jump became the median and nothing "stood out".
    said = findings(drift_rows([1.02, 0.82, 1.11, 24.0, 13.6, 17.5, 18.0]), [])
    assert said[0].startswith("avgpool moved at step 200: its diagram drift reached 24, 23.5x the median of the")


def test_a_transient_jump_is_found_and_a_steady_run_stands_out_nowhere():
    assert findings(drift_rows([1.0, 1.1, 0.9, 9.0, 1.0, 1.05]), [])[0].startswith("avgpool moved at step 200")
    steady = findings(drift_rows([1.0, 1.2, 0.9, 1.1, 1.3, 0.95, 1.15]), [])
    assert steady[0] == "No layer's diagram drift reached 3x the median of the checkpoints before it: no checkpoint " \
        "stands out."  # fmt: skip


def test_the_first_layer_to_move_is_named_first():
    rows = drift_rows([1.0, 1.0, 1.0, 1.0, 8.0], layer="h.1") + drift_rows([1.0, 1.0, 7.0, 7.0, 7.0], layer="h.0")
    assert findings(rows, [])[0].startswith("h.0 moved first at step 150")


def correlation(quantity, rho, p, n, layer="transformer.h.0"):
    return {"quantity": quantity, "layer": layer, "loss": "val_loss", "rho": rho, "p_value": p, "n": n}


def test_every_quantity_that_follows_a_loss_is_read_not_only_the_strongest():
    # The case: the entry with the largest |rho| had a point fewer (p = 0.083); others are below 0.05.
    correlations = [
        correlation("diagram_drift", -1.0, 0.083, 4),
        correlation("effective_rank", 1.0, 0.017, 5),
        correlation("participation_ratio", 0.9, 0.033, 5),
        correlation("h1_total_persistence", 0.2, 0.6, 5),
    ]
    said = findings(drift_rows([1.0, 1.0, 1.0]), correlations)[-1]
    assert said.startswith("2 quantities follow a loss at p < 0.05:")
    assert "effective rank at transformer.h.0 (val_loss, Spearman rho = +1.00, p = 0.017, 5 checkpoints)" in said
    assert "participation ratio at transformer.h.0" in said
    assert "diagram drift" not in said


def test_no_correlated_quantity_is_said_plainly():
    said = findings(drift_rows([1.0, 1.0, 1.0]), [correlation("effective_rank", 0.3, 0.4, 5)])[-1]
    assert said == "No quantity follows a loss at p < 0.05 over 5 checkpoints."
