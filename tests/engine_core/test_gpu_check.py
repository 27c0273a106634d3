"""bench.gpu_check, the prepared device check, runs on the CPU (``--tiny --device
cpu``) so that it cannot rot before a session gets a GPU."""

from bench.gpu_check import main


def test_gpu_check_tiny_on_the_cpu(tmp_path):
    results = main(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--skip", "gpu tests"])
    report = (tmp_path / "gpu_check.md").read_text()
    assert results == {
        "environment": "PASS", "gpu tests": "SKIPPED", "backends vs reference": "PASS",
        "greedy equality": "PASS", "CUDA paths": "PASS", "throughput": "PASS", "Llama-3-8B shapes": "PASS",
    }, report
    assert "| torch_varlen | float32 |" in report and "tree16 x" in report
    assert "| Llama 3 rope | ok |" in report and "| a drafter on the device | ok |" in report
    assert (tmp_path / "gpu_check.png").stat().st_size > 0
