"""What the kubelet stand-in tests (k8s_test.py, dra_test.py) share: their
checks and failure count, waits with a deadline, and the kubelet's API
messages compiled from the project's .proto files."""

import importlib
import os
import subprocess
import sys
import time

failures = 0


def check(name, ok, detail=""):
    global failures
    print(("PASS " if ok else "FAIL ") + name + ("" if ok else ": " + str(detail)), flush=True)
    if not ok:
        failures += 1
    return ok


def wait_until(fn, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    return fn()


def protos(src, work, names):
    """The messages of src/k8s/<name> for each name, compiled into work/gen."""
    gen = os.path.join(work, "gen")
    os.makedirs(gen, exist_ok=True)
    subprocess.run(["protoc", "--proto_path=" + os.path.join(src, "src", "k8s"), "--python_out=" + gen, *names],
                   check=True)
    sys.path.insert(0, gen)
    return [importlib.import_module(n.replace(".proto", "_pb2")) for n in names]
