#!/usr/bin/env python3
"""Which build of ggml's CPU kernels to serve quantized weights with: measured on the same tensors.

The quantized GGUF weights are multiplied by ggml's own kernels (``runtime/ggml_cpu.py``,
``block_matmul.c``). Two builds are compared here, side by side in one run, each in its own
child process, on the very same weight bytes:

- ``prebuilt``: the PyPI wheel ``libggml-python`` as published (ggml 0.20 compiled for AVX2, so
  that it runs on any x86-64 CPU of the last decade); downloaded here with ``pip download
  --only-binary``;
- ``native``: the build this process serves with (``ggml_cpu.library_dir()``): since 2026-12-03
  ggml 0.25 built by ``scripts/setup.sh`` for this CPU (AVX-512, VNNI, BF16 where the CPU has
  them; earlier, the wheel's own version rebuilt from its sdist with ``GGML_NATIVE``).

For each GGML type and weight shape (a layer of SmolLM2-135M, of the factory's small llama and
of Llama-2-7B), the time of one pass over the layer's seven matrices is measured for a decode
step (1 activation row, ``vec_dot``), a 4-stream batched step (4 rows, ``vec_dot``) and a
prompt chunk (512 rows: tiles expanded by ``to_float`` and the BLAS's sgemm); a third column,
"repacked", runs the same products from ggml's repacked copy where it has one (the native build;
``runtime/ggml_repack.py``: decode rows one GEMV each, prompt chunks its GEMM). Variants are
interleaved over ``--reps`` rounds (rotating order); medians are printed with the ratio
prebuilt / native (above 1: the native build is faster). Both builds compute llama.cpp's
products; the native build's products are checked equal to the prebuilt's within float rounding.

    .venv/bin/python scripts/bench_ggml_build.py
    .venv/bin/python scripts/bench_ggml_build.py --types q4_K,q8_0 --shapes 7b --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A layer's seven matrices, (out, in): q, k, v, o, gate, up, down.
SHAPES = {
    "smollm2": dict(hidden=576, kv=192, ffn=1536),
    "small": dict(hidden=768, kv=256, ffn=2048),
    "7b": dict(hidden=4096, kv=4096, ffn=11008),
}
TYPES = ("q4_0", "q4_1", "q5_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K")
ROWS = {"decode (1 row)": (1, False), "4 streams (4 rows)": (4, False), "prompt chunk (512 rows)": (512, True)}

CHILD = r"""
import json, sys, time
import numpy as np
from mlxcel_compat.runtime import backend
backend.load_optimized_blas()
from mlxcel_compat.runtime import block_weight
from mlxcel_compat.runtime import ggml_repack
spec = json.loads(sys.argv[1])
lib = block_weight.library()
assert not isinstance(lib, str), lib
out = {"features": lib.ggml.features, "times": {}, "checks": {}}
rng = np.random.default_rng(0)
for case in spec["cases"]:
    weights = [block_weight.BlockWeight(np.load(p, mmap_mode="r")[:], case["type_id"], n, k, lib)
               for p, (n, k) in zip(case["files"], case["shapes"])]
    if spec["repacked"]:  # the same products from ggml's repacked copy (decode rows: one GEMV each)
        repacked = [ggml_repack.repack(w.data, w.ggml_type, w.n, w.k) for w in weights]
        if any(r is None for r in repacked):
            continue
        for w, r in zip(weights, repacked):
            w.repacked = r
    for label, (m, tiles) in spec["rows"].items():
        xs = [rng.standard_normal((m, w.k), dtype=np.float32) for w in weights]
        outs = [np.empty((m, w.n), dtype=np.float32) for w in weights]
        def one_pass():
            t0 = time.perf_counter()
            for w, x, o in zip(weights, xs, outs):
                w.matmul(x, out=o, tiles=tiles)
            return time.perf_counter() - t0
        one_pass()  # warm: pages and scratch buffers
        reps = max(3, int(spec["budget_s"] / max(one_pass(), 1e-6)))
        times = sorted(one_pass() for _ in range(min(reps, spec["max_inner"])))
        out["times"][f"{case['key']}|{label}"] = times[len(times) // 2]
        out["checks"][f"{case['key']}|{label}"] = [float(o[0, :8].sum()) for o in outs]
print(json.dumps(out))
"""


def prebuilt_libs(cache: Path, version: str) -> Path:
    """The published wheel's two libraries, unpacked under ``cache`` (downloaded once)."""
    target = cache / f"libggml-python-{version}-prebuilt"
    lib = next(iter(target.glob("libggml/lib*/libggml-cpu.so")), None) if target.exists() else None
    if lib is None:
        wheels = cache / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        f"libggml-python=={version}", "-d", str(wheels)], check=True)
        wheel = next(wheels.glob(f"libggml_python-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
        lib = next(target.glob("libggml/lib*/libggml-cpu.so"))
    return lib.parent


def make_weights(directory: Path, types: list[str], shapes: list[str]) -> list[dict]:
    """Random float32 weights quantized once by ggml's quantizer, saved as .npy: both builds read the same bytes."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    from mlxcel_compat.runtime import ggml_cpu

    kernels = ggml_cpu.kernels()
    assert not isinstance(kernels, str), kernels
    rng = np.random.default_rng(1234)
    cases = []
    for shape_key in shapes:
        d = SHAPES[shape_key]
        mats = [(d["hidden"], d["hidden"]), (d["kv"], d["hidden"]), (d["kv"], d["hidden"]), (d["hidden"], d["hidden"]),
                (d["ffn"], d["hidden"]), (d["ffn"], d["hidden"]), (d["hidden"], d["ffn"])]
        for name in types:
            type_id = int(T[name.upper()] if name.upper() in T.__members__ else T[name])
            block = GGML_QUANT_SIZES[T(type_id)][0]
            if any(k % block for _, k in mats):
                continue  # e.g. K-quants on SmolLM2's 576 columns: its files use Q4_1/Q8_0 there
            files = []
            for i, (n, k) in enumerate(mats):
                path = directory / f"{shape_key}-{name}-{i}.npy"
                values = rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)
                np.save(path, kernels.quantize(type_id, values))
                files.append(str(path))
            cases.append({"key": f"{shape_key} {name}", "type_id": type_id, "files": files, "shapes": mats})
    return cases


def main() -> int:
    from importlib.metadata import version as dist_version

    from mlxcel_compat.runtime import ggml_cpu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--shapes", default="smollm2,small,7b")
    parser.add_argument("--reps", type=int, default=3, help="rounds, the builds interleaved")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of passes per measurement")
    parser.add_argument("--cache-dir", default=os.environ.get("MLXCEL_BENCH_CACHE",
                                                                str(Path.home() / ".cache/mlxcel_compat/bench-ggml")))
    parser.add_argument("--native-lib", help="the native build's library directory (default: the installed package's)")
    parser.add_argument("--json")
    args = parser.parse_args()
    version = dist_version("libggml-python")
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    native = Path(args.native_lib) if args.native_lib else ggml_cpu.library_dir()
    builds = {"prebuilt": prebuilt_libs(cache, version), "native": native, "native repacked": native}
    types = [t for t in args.types.split(",") if t]
    shapes = [s for s in args.shapes.split(",") if s]
    results: dict[str, dict[str, list[float]]] = {b: {} for b in builds}
    features: dict[str, list[str]] = {}
    checks: dict[str, dict[str, list[float]]] = {}
    features["native repacked"] = []
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cases = make_weights(Path(tmp), types, shapes)
        for rep in range(args.reps):
            order = list(builds) if rep % 2 == 0 else list(builds)[::-1]
            for build in order:
                library = builds["native" if build == "native repacked" else build]
                spec = json.dumps({"cases": cases, "rows": ROWS, "budget_s": args.budget, "max_inner": 200,
                                   "repacked": build == "native repacked"})
                env = {**os.environ, "MLXCEL_GGML_LIB": str(library), "PYTHONPATH": str(ROOT)}
                done = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, capture_output=True, text=True)
                if done.returncode:
                    print(done.stderr, file=sys.stderr)
                    return 1
                out = json.loads(done.stdout.strip().splitlines()[-1])
                features[build] = out["features"]
                checks.setdefault(build, {}).update(out["checks"])
                for key, t in out["times"].items():
                    results[build].setdefault(key, []).append(t)
    print(f"ggml {version}; prebuilt: {'/'.join(features['prebuilt'])} ({builds['prebuilt']}); "
          f"native: {'/'.join(features['native'])} ({builds['native']}); {args.reps} rounds, medians")
    print(f"{'weights':16s} {'product':26s} {'prebuilt ms':>12s} {'native ms':>10s} {'repacked ms':>12s} "
          f"{'prebuilt/native':>16s} {'native/repacked':>16s}")
    table = []
    for key in results["native"]:
        case, label = key.split("|")
        a, b = statistics.median(results["prebuilt"][key]), statistics.median(results["native"][key])
        c = statistics.median(results["native repacked"][key]) if key in results["native repacked"] else None
        worst = max(abs(x - y) / max(abs(x), 1e-3) for x, y in zip(checks["prebuilt"][key], checks["native"][key]))
        print(f"{case:16s} {label:26s} {a * 1e3:12.3f} {b * 1e3:10.3f} "
              + (f"{c * 1e3:12.3f} {a / b:16.2f} {b / c:16.2f}" if c else f"{'-':>12s} {a / b:16.2f} {'-':>16s}")
              + ("" if worst < 1e-3 else f"   (products differ: {worst:.1e})"))
        table.append({"weights": case, "product": label, "prebuilt_s": a, "native_s": b, "repacked_s": c,
                      "prebuilt_over_native": a / b, "native_over_repacked": b / c if c else None})
    if args.json:
        Path(args.json).write_text(json.dumps({"version": version, "features": features, "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
