"""gpu.py's modes that run the scripts beside it (kernel tables, profiles, memory, loaders): not product verbs.
Each returns its summary line, as gpu.py's own modes do; gpu.py's MODES takes them all."""

from __future__ import annotations

from gpu_call import ROOT, Call, speech_wav, split


def mode_memory(c: Call) -> str:
    c.need(c.cfg.bundle)
    speech_wav(c, "/tmp/long.wav", c.cfg.long_seconds)
    rc = c.script("memory_peak.py", "--bundle", str(ROOT / c.cfg.bundle), "--audio", "/tmp/long.wav",
                  "--out", str(c.out / "memory.json"), *split(c.cfg.memory_args), log="memory.log")  # fmt: skip
    c.check(rc, "memory_peak.py", "memory.log")
    return "; ".join(x[3:] for x in c.lines("memory.log", "## "))


def mode_weights(c: Call) -> str:
    rc = c.script("load_weights.py", "--dir", str(ROOT / "artifacts/wbench"), "--rounds", "2",
                  "--out", str(c.out / "weights.md"), log="weights.log")  # fmt: skip
    c.check(rc, "load_weights.py", "weights.log")
    rows = [x for x in c.lines("weights.md", "| ") if x.split("|")[1].strip().startswith(("ours", "safe", "grouped"))]
    return "; ".join("|".join(x.split("|")[1:4]).strip() for x in rows)


def mode_profile(c: Call) -> str:
    c.need(c.cfg.bundle)
    rc = c.script("profile_decode.py", *split(c.cfg.profile_args), str(ROOT / c.cfg.bundle),
                  stdout="3b_profile.md", log="3b_profile.log")  # fmt: skip
    c.check(rc, "profile_decode.py", "3b_profile.log")
    return "; ".join(x[3:] for x in c.lines("3b_profile.md", "## ") if "replays back to back" in x)


def mode_kernels(c: Call) -> str:
    rc = c.script("decode_kernels.py", "--parts", c.cfg.kernel_parts, "--fill", c.cfg.kernel_fill,
                  *split(c.cfg.kernel_args), "--out", str(c.out / "decode_kernels.json"), log="decode_kernels.log")  # fmt: skip
    c.check(rc, "decode_kernels.py", "decode_kernels.log")
    return "decode_kernels.json"


def mode_prefill(c: Call) -> str:
    rc = c.script("prefill_attention.py", *split(c.cfg.prefill_args), "--out", str(c.out / "prefill.json"),
                  log="prefill.log")  # fmt: skip
    c.check(rc, "prefill_attention.py", "prefill.log")
    return "prefill.json"


def mode_int4(c: Call) -> str:
    rc = c.script("int4_kernels.py", *split(c.cfg.int4_args), "--out", str(c.out / "int4.json"), log="int4.log")
    c.check(rc, "int4_kernels.py", "int4.log")
    return "; ".join(c.lines("int4.log", "step int4")) or "int4.json"


def mode_fp8_kernels(c: Call) -> str:
    """The decode step eager in one CUDA graph, bf16 then fp8 (two processes, one card), and the fp8 GEMVs' configs
    tuned inside the step: what the fp8 kernels buy before an export, and the table's entries for them."""
    steps = {}
    for name, extra in (("bf16", ["--parts", "step"]), ("fp8", ["--parts", "step,tune", "--fp8"])):
        out = c.out / f"decode_kernels_{name}.json"
        rc = c.script("decode_kernels.py", *extra, "--fill", c.cfg.kernel_fill, "--out", str(out),
                      log=f"decode_kernels_{name}.log")  # fmt: skip
        c.check(rc, f"decode_kernels.py ({name})", f"decode_kernels_{name}.log")
        steps[name] = (c.read_json(out.name) or {}).get("step", {})
    ms = {k: v.get("step_compiled_ms", float("nan")) for k, v in steps.items()}
    tuned = (c.read_json("decode_kernels_fp8.json") or {}).get("in_step_tuning", {})
    best = ", ".join(f"{k} {v['best']}" for k, v in tuned.items() if k != "pdl_ab" and "best" in v)
    return f"step compiled: bf16 {ms['bf16']:.3f} ms, fp8 {ms['fp8']:.3f} ms; fp8 best in step: {best}"


MODES = {name[5:]: fn for name, fn in globals().items() if name.startswith("mode_")}
