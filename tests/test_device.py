"""The {gpu} wildcard value: normalization of CUDA device names, and cpu without CUDA."""

import pytest

from specpilot.device import detect_gpu, normalize_gpu_name


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H100 NVL", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H200 NVL", "h200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx_pro_6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx_pro_6000"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "geforce_rtx_4090"),
    ("Tesla V100-SXM2-16GB", "tesla_v100_sxm2_16gb"),
    ("  NVIDIA   Some  New-GPU (rev 2) ", "some_new_gpu_rev_2"),
])
def test_normalize(name, expected):
    assert normalize_gpu_name(name) == expected


def test_normalized_names_are_wildcard_safe():
    for name in ["NVIDIA H100 80GB HBM3", "AMD Instinct MI300X", "???", "NVIDIA"]:
        out = normalize_gpu_name(name)
        assert out and all(c.islower() or c.isdigit() or c == "_" for c in out), out
        assert out != "cpu"


def test_detect_without_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect_gpu() == "cpu"


def test_detect_with_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert detect_gpu() == "h200"


def _args(module, argv):
    import argparse

    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_ceilings_on_cpu(tmp_path):
    pytest.importorskip("torch")
    import json

    from specpilot import ceilings

    out = tmp_path / "ceilings.json"
    args = _args(ceilings, ["--device", "cpu", "--out", str(out), "--expect-gpu", "cpu",
                            "--copy-mib", "8", "--matmul-n", "128", "--repeats", "2"])
    assert ceilings.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "cpu" and doc["dtype"] == "float32"
    assert doc["memory_bandwidth_bytes_per_s"] > 0 and doc["matmul_flop_per_s"] > 0
    assert {"device_name", "torch", "timestamp", "threads"} <= doc.keys()
    # per thread count: one thread and every thread given, the top level being every thread's
    assert set(doc["per_threads"]) == {str(n) for n in ceilings.cpu_thread_counts(doc["threads"])}
    assert "1" in doc["per_threads"]
    every = doc["per_threads"][str(doc["threads"])]
    assert every["matmul_flop_per_s"] == doc["matmul_flop_per_s"]
    one, n = ceilings.for_threads(doc, 1)
    assert n == 1 and one["memory_bandwidth_bytes_per_s"] == doc["per_threads"]["1"]["memory_bandwidth_bytes_per_s"]


def test_ceilings_for_threads_picks_the_matching_measurement():
    from specpilot.ceilings import cpu_thread_counts, for_threads

    assert cpu_thread_counts(4) == [1, 4] and cpu_thread_counts(1) == [1]
    top = {"memory_bandwidth_bytes_per_s": 80e9, "matmul_flop_per_s": 220e9}
    doc = {**top, "threads": 2, "device": "cpu",
           "per_threads": {"1": {"memory_bandwidth_bytes_per_s": 30e9, "matmul_flop_per_s": 100e9}, "2": top}}
    assert for_threads(doc, 1) == ({"memory_bandwidth_bytes_per_s": 30e9, "matmul_flop_per_s": 100e9}, 1)
    assert for_threads(doc, 2) == (top, 2)
    assert for_threads(doc, None) == (top, 2)  # records without threads: the top level, as before
    assert for_threads(doc, 8) == (top, 2)  # not measured: no floor made up, the measured count said
    assert for_threads(top, 1) == (top, None)  # an old file: neither per_threads nor threads


def test_ceilings_refuses_wrong_device(tmp_path):
    pytest.importorskip("torch")
    from specpilot import ceilings
    from specpilot.errors import SpecpilotError

    args = _args(ceilings, ["--device", "cpu", "--out", str(tmp_path / "c.json"), "--expect-gpu", "h100"])
    with pytest.raises(SpecpilotError, match="h100"):
        ceilings.run(args)


def test_kernels_manifest_and_use(tmp_path):
    pytest.importorskip("torch")
    import json

    from specpilot import kernels_build
    from specpilot.errors import SpecpilotError

    assert kernels_build.run(_args(kernels_build, ["--gpu", "cpu", "--out-dir", str(tmp_path)])) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # nothing undeclared beside it
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert doc["gpu"] == "cpu" and doc["applies"] is False and doc["kernels"] == {}
    agent = tmp_path / "kernel-agent.json"
    agent.write_text(json.dumps({"gpu": "cpu", "applies": False, "configs": {}, "reason": "no GPU kernels apply on cpu"}))
    used = kernels_build.use_kernel_outputs(str(tmp_path / "manifest.json"), str(agent))
    assert used["applies"] is False and "cpu" in used["reason"]
    agent.write_text(json.dumps({"gpu": "h200", "applies": False, "configs": {}}))
    with pytest.raises(SpecpilotError, match="h200"):
        kernels_build.use_kernel_outputs(str(tmp_path / "manifest.json"), str(agent))
    # the packaged H200 table is found (package data) and counted
    tables = kernels_build.packaged_tables("h200")
    assert tables["w12"]["table"] == "w12_h200.json" and tables["w12"]["entries"] > 10
    assert kernels_build.packaged_tables("cpu") == {}


def test_kernels_refuses_gpu_without_cuda(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from specpilot import kernels_build
    from specpilot.errors import SpecpilotError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SpecpilotError, match="h100"):
        kernels_build.run(_args(kernels_build, ["--gpu", "h100", "--out-dir", str(tmp_path)]))
