"""scripts/plot_results.py: the best peer of a case, and a picture drawn from a small results file."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import plot_results  # noqa: E402

RESULTS = {"device": "NVIDIA H200", "commit": "newest", "date": "2026-12-01T10:00:00Z", "results": [
    {"kernel": "gemm", "case": "4096x4096x64", "impl": "tk", "median_ms": 0.010, "commit": "aaaaaaa1"},
    {"kernel": "gemm", "case": "4096x4096x64", "impl": "cublas", "median_ms": 0.012, "commit": "aaaaaaa1"},
    {"kernel": "attn_decode", "case": "b8_ctx8192", "impl": "tk", "median_ms": 0.080, "commit": "bbbbbbb2"},
    {"kernel": "attn_decode", "case": "b8_ctx8192", "impl": "fa3", "median_ms": 0.088, "commit": "bbbbbbb2"},
    {"kernel": "attn_decode", "case": "b8_ctx8192", "impl": "vllm_fa3", "median_ms": 0.076, "commit": "bbbbbbb2"},
    {"kernel": "attn_decode", "case": "tk_only", "impl": "tk", "median_ms": 0.05, "commit": "bbbbbbb2"},
    # serve rows carry throughput: the fastest peer has the most tok/s, whatever its median_ms says
    {"kernel": "serve", "case": "offline", "impl": "tk", "median_ms": 2000.0, "tok_s": 30000.0, "commit": "c3"},
    {"kernel": "serve", "case": "offline", "impl": "flash_attn", "median_ms": 1000.0, "tok_s": 33000.0},
    {"kernel": "serve", "case": "offline", "impl": "triton", "median_ms": 900.0, "tok_s": 20000.0},
]}


def test_best_peer_is_the_fastest_present():
    families = plot_results.case_ratios(RESULTS)
    (gemm,) = families["gemm"]
    assert gemm.peer == "cublas" and gemm.ratio == pytest.approx(1.2)
    (decode,) = families["attn_decode"]  # the case without a peer has no bar
    assert decode.peer == "vllm_fa3" and decode.ratio == pytest.approx(0.076 / 0.080)
    assert decode.peers == ("fa3", "vllm_fa3") and decode.commit == "bbbbbbb2"
    (serve,) = families["serve"]
    assert serve.peer == "flash_attn" and serve.ratio == pytest.approx(30000 / 33000)
    assert plot_results.best_peer({"tk": {"median_ms": 1.0}}) is None
    assert plot_results.best_peer({"fa3": {"median_ms": 1.0}}) is None


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "h200.json"
    results.write_text(json.dumps(RESULTS))
    png = plot_results.plot(results, tmp_path / "out" / "h200.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_a_tk_only_run_is_not_drawn_and_does_not_fail(tmp_path, capsys):
    """scripts/ab.py's bench runs time tk alone (no peer present): bench.py must still exit 0 with its rows written
    (its picture step raised, the run counted as failed and every A/B of a session's call was lost)."""
    import bench

    results = tmp_path / "ab.json"
    results.write_text(json.dumps({**RESULTS, "results": [r for r in RESULTS["results"] if r["impl"] == "tk"]}))
    bench.draw_picture(results)
    assert not results.with_suffix(".png").exists()
    assert "not drawn" in capsys.readouterr().out
