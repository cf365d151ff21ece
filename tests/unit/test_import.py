import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "tensorboard", "accelerate")


def test_import_topocallbacks_does_not_import_a_framework():
    code = (
        "import sys, topocallbacks, topocallbacks.functional, topocallbacks.collapse_index; "
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_import_topocallbacks_does_not_even_import_torch():
    # The functional core reads torch tensors only if the caller already imported torch (einops' habit).
    code = "import sys, topocallbacks; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_public_names():
    import topocallbacks

    assert set(topocallbacks.__all__) >= {"CollapseIndex", "CollapseReport", "BettiNumbers", "functional"}
    for name in topocallbacks.__all__:
        assert hasattr(topocallbacks, name)
    for name in topocallbacks.functional.__all__:
        value = getattr(topocallbacks.functional, name)
        # Pure functions live in the functional core; the weights' names and check come from the settings.
        assert name.isupper() or value.__module__.startswith(("topocallbacks.functional", "topocallbacks.settings"))
