"""One device per GPU job (issue 40), tested on CPU with fake devices (SPECPILOT_FAKE_DEVICES):
N jobs over K devices never share one and do run side by side, a killed job's device is freed,
a timed job runs alone on its device; bad input (more GPUs asked for than the host has, a device
gone) is one error; the workflow wraps every GPU rule and no CPU rule; the table's warning when one
comparison mixes devices of different speed; device_identity for the records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpilot.devices import (Device, acquire, check_pool, device_identity, host_devices, pool, speed_warnings,
                               try_lock)
from specpilot.errors import SpecpilotError

ROOT = Path(__file__).resolve().parents[1]
H100 = "NVIDIA H100 80GB HBM3"
# a job: note the device it was given and when, then sleep (seconds from argv[2])
JOB = ("import json, os, sys, time; t0 = time.time(); time.sleep(float(sys.argv[2])); "
       "open(sys.argv[1], 'a').write(json.dumps({'dev': os.environ['CUDA_VISIBLE_DEVICES'], "
       "'index': os.environ['SPECPILOT_DEVICE_INDEX'], 'start': t0, 'end': time.time()}) + '\\n')")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Two fake H100s and one A100; lock files under tmp_path."""
    env = {"SPECPILOT_FAKE_DEVICES": f"{H100},{H100},NVIDIA A100-SXM4-80GB", "SPECPILOT_DEVICE_DIR": str(tmp_path / "locks")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SPECPILOT_DEVICE_POOL", raising=False)
    return {**os.environ, **env}


def wrapper(env, *cmd, gpu="h100", **kw):
    return subprocess.Popen([sys.executable, "-m", "specpilot.devices", "run", "--gpu", gpu, "--", *cmd], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_pool_is_the_visible_devices_of_the_gpu_name(fake, monkeypatch):
    assert [d.uuid for d in pool("h100")] == ["FAKE-0", "FAKE-1"]
    assert [d.uuid for d in pool("a100")] == ["FAKE-2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert host_devices() == [Device(1, "FAKE-1", H100), Device(2, "FAKE-2", "NVIDIA A100-SXM4-80GB")]
    assert [d.uuid for d in pool("h100")] == ["FAKE-1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "FAKE-2,7,0")  # CUDA stops at an entry it cannot resolve
    assert [d.uuid for d in host_devices()] == ["FAKE-2"]


def test_n_jobs_over_k_devices_never_share_one_and_run_side_by_side(fake, tmp_path):
    out = tmp_path / "jobs.jsonl"
    procs = [wrapper(fake, sys.executable, "-c", JOB, str(out), "0.6") for _ in range(6)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "specpilot: device" in err and "taken at" in err and "released at" in err  # in the job's log
    jobs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(jobs) == 6 and {j["dev"] for j in jobs} == {"FAKE-0", "FAKE-1"}  # never the A100
    for dev in ("FAKE-0", "FAKE-1"):
        spans = sorted((j["start"], j["end"]) for j in jobs if j["dev"] == dev)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    # the two devices were used at the same time (not one job after another on the whole host)
    assert any(a["dev"] != b["dev"] and a["start"] < b["end"] and b["start"] < a["end"] for a in jobs for b in jobs)


def held(folder: Path, d: Device) -> bool:
    """Does a job hold device ``d``'s lock? (a lock taken to look is given back at once)"""
    fd = try_lock(folder, d)
    if fd is None:
        return True
    os.close(fd)
    return False


def test_a_killed_job_frees_its_device(fake, tmp_path):
    env = {**fake, "SPECPILOT_FAKE_DEVICES": H100}  # one device
    job = wrapper(env, sys.executable, "-c", "import time; time.sleep(60)", start_new_session=True)
    deadline = time.time() + 30
    while not held(Path(env["SPECPILOT_DEVICE_DIR"]), Device(0, "FAKE-0", H100)):
        assert time.time() < deadline, "the job never took the device"
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGKILL)  # what a kill does to a job: its whole process group, no cleanup
    job.wait(timeout=30)
    deadline = time.time() + 10
    while held(Path(env["SPECPILOT_DEVICE_DIR"]), Device(0, "FAKE-0", H100)):  # the kernel frees it
        assert time.time() < deadline, "the killed job's device stayed taken"
        time.sleep(0.05)
    t0 = time.time()
    nxt = wrapper(env, sys.executable, "-c", "print('ran')")
    out, err = nxt.communicate(timeout=60)
    assert nxt.returncode == 0 and out.strip() == "ran" and time.time() - t0 < 20, err


def test_a_failed_or_killed_command_frees_the_device_and_its_status_is_kept(fake):
    env = {**fake, "SPECPILOT_FAKE_DEVICES": H100}
    p = wrapper(env, sys.executable, "-c", "import sys; sys.exit(7)")
    p.communicate(timeout=60)
    assert p.returncode == 7
    p = wrapper(env, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGKILL and "(exit -9)" in err
    p = wrapper(env, sys.executable, "-c", "print('free')")
    assert p.communicate(timeout=60)[0].strip() == "free"


def test_a_timed_job_runs_alone_on_its_device(fake, tmp_path):
    """A timing cell holds its device exclusively: other GPU jobs wait or take the other device."""
    out = tmp_path / "jobs.jsonl"
    timed = wrapper(fake, sys.executable, "-c", JOB, str(out), "1.5")
    time.sleep(0.5)
    others = [wrapper(fake, sys.executable, "-c", JOB, str(out), "0.3") for _ in range(3)]
    for p in [timed, *others]:
        p.communicate(timeout=120)
    jobs = [json.loads(line) for line in out.read_text().splitlines()]
    t = max(jobs, key=lambda j: j["end"] - j["start"])
    assert t["end"] - t["start"] >= 1.4
    same = [j for j in jobs if j is not t and j["dev"] == t["dev"]]
    assert all(j["end"] <= t["start"] or j["start"] >= t["end"] for j in same), (t, same)
    assert any(j["dev"] != t["dev"] and t["start"] < j["start"] < t["end"] for j in jobs)  # the rest ran meanwhile


def test_acquire_waits_then_times_out(tmp_path):
    d = Device(0, "FAKE-0", H100)
    held = try_lock(tmp_path, d)
    waited = []
    with pytest.raises(SpecpilotError, match="no device of 1 came free within 0 s"):
        acquire([d], tmp_path, poll_s=0.05, timeout_s=0.2, on_wait=lambda: waited.append(1))
    assert waited == [1]
    os.close(held)
    got, fd = acquire([d], tmp_path, poll_s=0.05, timeout_s=1)
    assert got == d
    os.close(fd)


def test_a_device_gone_is_one_error(fake):
    env = {**fake, "SPECPILOT_DEVICE_POOL": "FAKE-0,FAKE-1,FAKE-2", "SPECPILOT_FAKE_DEVICES": H100}
    p = wrapper(env, sys.executable, "-c", "print('should not run')")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and err.startswith("specpilot: error: device(s) FAKE-1, FAKE-2 "
                                                                       "of this run's h100 pool are gone")
    with pytest.raises(SpecpilotError, match="a b200 job, but this host has no visible b200 device"):
        check_pool("b200", [], "")


def test_device_identity_for_the_records(monkeypatch):
    monkeypatch.setenv("SPECPILOT_DEVICE_INDEX", "3")
    monkeypatch.setenv("SPECPILOT_DEVICE_UUID", "GPU-1234")
    monkeypatch.setenv("SPECPILOT_DEVICE_NAME", H100)
    assert device_identity() == {"device_index": 3, "device_uuid": "GPU-1234", "device_name": H100}
    for k in ("SPECPILOT_DEVICE_INDEX", "SPECPILOT_DEVICE_UUID", "SPECPILOT_DEVICE_NAME"):
        monkeypatch.delenv(k)
    import torch

    if not torch.cuda.is_available():
        assert device_identity() == {"device_index": None, "device_uuid": None, "device_name": "cpu"}


def rec(dep, bench, uuid, engine="ar", conc=1):
    return {"deployment": dep, "benchmark": bench, "concurrency": conc, "engine": engine, "device_uuid": uuid}


def test_speed_warning_names_comparisons_mixing_device_speeds():
    speeds = {"GPU-a": 3.0e12, "GPU-b": 3.02e12, "GPU-slow": 2.4e12}
    same_speed = [rec("d", "gsm8k", "GPU-a"), rec("d", "gsm8k", "GPU-a", "stock"), rec("d", "mbpp", "GPU-b")]
    assert speed_warnings(same_speed, speeds) == []  # 0.7 % apart: one speed
    mixed = same_speed + [rec("e", "gsm8k", "GPU-slow")]
    [w] = speed_warnings(mixed, speeds)
    assert w.startswith("all deployments at concurrency 1 ran on devices of different speed: GPU-a (3000 GB/s), "
                        "GPU-b (3020 GB/s), GPU-slow (2400 GB/s)")
    cell = [rec("d", "gsm8k", "GPU-a"), rec("d", "gsm8k", "GPU-slow", "stock")]
    warnings = speed_warnings(cell, speeds)
    assert [w.split(" ran on")[0] for w in warnings] == ["cell d/gsm8k/c1", "d at concurrency 1 (its geomean row)",
                                                        "all deployments at concurrency 1"]
    assert "speed unknown" in speed_warnings([rec("d", "a", "GPU-a"), rec("d", "b", "GPU-x")], speeds)[0]
    assert speed_warnings([{**rec("d", "a", None)}, rec("d", "b", "GPU-a")], speeds) == []  # CPU / old records


# ---- the workflow ----

def dry_run(env, *args):
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--snakefile", str(ROOT / "Snakefile"),
                           *args], cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)


def shell_commands(out: str) -> dict[str, list[str]]:
    """rule -> the shell commands of its jobs in a dry run's listing (-p)."""
    import re

    found: dict[str, list[str]] = {}
    for m in re.finditer(r"^(?:local)?(?:rule|checkpoint) (\w+):\n(?:    .*\n)+", out, re.M):
        rest = out[m.end():]
        first = rest.split("\n", 1)[0]
        cmd = first[len("Shell command: "):] if first.startswith("Shell command: ") else ""
        found.setdefault(m[1], []).append(cmd)
    return found


GPU_RULES = {"ceilings", "run_engine", "force", "kernels", "kernel_agent", "round_references", "round_plan",
             "round_agent", "round_integrate"}


def test_every_gpu_rule_runs_through_the_wrapper_and_no_cpu_job_does(fake, tmp_path):
    r = dry_run(fake, "--directory", str(tmp_path), "--configfile", str(ROOT / "config" / "config.yaml"),
                str(ROOT / "config" / "paper.yaml"), "--config", "gpu=h100")
    assert r.returncode == 0, r.stderr[-3000:]
    cmds = shell_commands(r.stdout)
    assert GPU_RULES - {"round_agent"} <= set(cmds)  # agents follow the plan checkpoint
    for rule, lines in cmds.items():
        wrapped = [c.lstrip().startswith("python -m specpilot.devices run --gpu h100 -- python -m specpilot") for c in lines]
        assert all(wrapped) if rule in GPU_RULES else not any(wrapped), (rule, lines[:1])
    assert "device_speeds" in cmds and "--devices results/h100/devices.json" in cmds["table"][0]
    r = dry_run(fake, "--directory", str(tmp_path / "cpu"), "--configfile", str(ROOT / "config" / "config.yaml"))
    assert r.returncode == 0 and "specpilot.devices" not in r.stdout and "device_speeds" not in r.stdout


def test_more_gpus_asked_for_than_the_host_has_is_one_error(fake, tmp_path):
    r = dry_run(fake, "--directory", str(tmp_path), "--configfile", str(ROOT / "config" / "config.yaml"),
                str(ROOT / "config" / "paper.yaml"), "--config", "gpu=h100", "--resources", "gpu=4")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    [line] = [ln for ln in out.splitlines() if "--resources gpu=4" in ln]
    assert line == (f"specpilot: --resources gpu=4, but this host has 3 CUDA device(s) (0: {H100} (FAKE-0), "
                    f"1: {H100} (FAKE-1), 2: NVIDIA A100-SXM4-80GB (FAKE-2)); ask for at most 3")
    ok = dry_run(fake, "--directory", str(tmp_path), "--configfile", str(ROOT / "config" / "config.yaml"),
                 str(ROOT / "config" / "paper.yaml"), "--config", "gpu=h100", "--resources", "gpu=2")
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_every_rule_asking_for_a_gpu_is_wrapped():
    """Static check over rules/*.smk: a rule with resources gpu=gpu_count runs through the wrapper
    (the dry run above cannot show the agents, which follow the plan checkpoint)."""
    import re

    text = "\n".join(p.read_text() for p in sorted((ROOT / "rules").glob("*.smk")))
    rules = re.split(r"^\s*(?:rule|checkpoint) (\w+):\n", text, flags=re.M)[1:]
    asking = {name: body for name, body in zip(rules[::2], rules[1::2]) if "gpu=gpu_count" in body}
    assert set(asking) == GPU_RULES
    for name, body in asking.items():
        assert "on_device=on_device" in body and '"{params.on_device} python -m specpilot' in body, name
