"""The benchmark harness itself, on the CPU: FLOP counting, and a smoke run of
`python -m benchmarks.run` on tiny workloads in interpret mode (the GPU systems report
themselves unavailable here)."""

import dataclasses
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import run, systems as sy, workloads as wl
import pallas_prefill as pp
from pallas_prefill import config as config_lib
from pallas_prefill import masks


@pytest.mark.parametrize("q_lens,kv_lens,mask,pairs", [
    ([4096], None, masks.CausalMask(), 4096 * 4097 // 2),
    ([10], None, masks.SlidingWindowCausalMask(3), 1 + 2 + 3 * 8),
    ([10], None, masks.ChunkedCausalMask(4), 10 + 10 + 3),
    ([3], [5], masks.NullMask(), 15),
    ([5], [3], masks.CausalMask(), 0 + 0 + 1 + 2 + 3),  # cross-attention: start_pos -2
    ([2, 3], [6, 3], masks.CausalMask(), 5 + 6 + 6),  # a cached prefix of 4
])
def test_visible_pairs(q_lens, kv_lens, mask, pairs):
  assert wl.visible_pairs(q_lens, kv_lens, mask) == pairs


def test_harness_smoke_run_writes_results(tmp_path, capsys):
  run.main(["--kernels", "mha", "--workloads", *wl.SMOKE, "--systems", "pallas_prefill",
            "pallas_prefill_contiguous", "xla_padded", "cudnn_packed", "--out",
            str(tmp_path)])
  printed = capsys.readouterr().out
  assert "n/a" in printed  # cuDNN needs a GPU: said, not fatal
  results = json.loads((tmp_path / "results.json").read_text())
  assert {"date", "commit", "jax", "gpu", "matmul_tflops"} <= set(results["meta"])
  got = {(r["workload"], r["system"]): r for r in results["rows"]}
  assert set(got) == {("tiny", "pallas_prefill"), ("tiny", "xla_padded"),
                      ("tiny_paged", "pallas_prefill"),
                      ("tiny_paged", "pallas_prefill_contiguous")}
  md = (tmp_path / "results.md").read_text()
  for r in got.values():
    assert set(r) == {"kernel", "workload", "system", "backend", "ms", "tflops",
                      "first_call_s", "relerr", "correct"}
    assert r["backend"] == ("" if r["system"] == "xla_padded" else "triton")
    assert r["correct"] and r["relerr"] < 1e-2 and r["ms"] > 0 and r["tflops"] > 0
    # The first call traces and compiles: slower than a timed call (interpret mode too).
    assert r["first_call_s"] > r["ms"] / 1e3, r
    assert (f"| mha | {r['workload']} | {r['system']} | {r['backend']} | {r['ms']:.3f} | "
            f"{r['tflops']:.1f} | {r['first_call_s']:.3f} | {r['relerr']:.1e} | yes |") in md
  assert "| first call s |" in md.splitlines()[0]


def test_padded_and_soft_cap_systems_run_and_are_checked(monkeypatch, tmp_path, capsys):
  """Ours on padded arrays (``dot_product_attention``, MHA) and ours soft-capped (MHA and
  MLA) in interpret mode on ``tiny``: correct, their backend read from the lowered
  program, and results.md's ratios against our packed call; neither serves the paged
  ``tiny_paged``, nor padded MLA. With a cap of 1 the check sees the cap: the output lies
  close to the capped reference, and the uncapped reference far from it. (One call each:
  MLA's interpreted calls take seconds.)"""
  monkeypatch.setattr(run, "bench_jax", _call_once)
  monkeypatch.setattr(sy, "SOFT_CAP", 1.0)
  run.main(["--kernels", "mha", "--workloads", "tiny", "--systems", "pallas_prefill_default",
            "pallas_prefill_padded", "pallas_prefill_softcap", "xla_padded", "--out",
            str(tmp_path / "mha")])
  run.main(["--kernels", "mla", "--workloads", "tiny", "--systems", "pallas_prefill_padded",
            "pallas_prefill_softcap", "--out", str(tmp_path / "mla")])
  assert "MHA only: MLA has no padded entry point" in capsys.readouterr().out
  got = {}
  for kind in ("mha", "mla"):
    results = json.loads((tmp_path / kind / "results.json").read_text())
    got.update({(r["kernel"], r["system"]): r for r in results["rows"]})
  assert set(got) == {("mha", "pallas_prefill_default"), ("mha", "pallas_prefill_padded"),
                      ("mha", "pallas_prefill_softcap"), ("mha", "xla_padded"),
                      ("mla", "pallas_prefill_softcap")}
  for key, r in got.items():
    if key[1] != "xla_padded":
      assert r["backend"] == "auto: triton"  # interpret mode: auto picks Triton
    assert r["correct"] and r["relerr"] < 1e-2, key
  for kind in ("mha", "mla"):
    problem = sy.make_problem(kind, wl.WORKLOADS["tiny"], 0)
    assert run.rel_err(sy.reference(problem), sy.reference(problem, logits_soft_cap=1.0)) > (
        max(run.TOLERANCE, 10 * got[(kind, "pallas_prefill_softcap")]["relerr"]))
    paged = [sy.make_problem(kind, wl.WORKLOADS["tiny_paged"], 0)]
    for name in ("pallas_prefill_padded", "pallas_prefill_softcap"):
      with pytest.raises(sy.Unavailable):
        sy.prepare(name, paged)
  md = (tmp_path / "mha" / "results.md").read_text()
  assert "| mha | tiny | pallas_prefill_padded | auto: triton |" in md
  # Every timing is _call_once's millisecond: each ratio is 1.
  assert "| mha | tiny | 1.000 | 1.000 | - | - | 1.00x (xla_padded) | - | - |" in md
  assert "Ratios of time" not in (tmp_path / "mla" / "results.md").read_text()  # no pair


def test_comparisons_take_correct_rows_and_the_fastest_padded_anchor():
  row = lambda system, ms, correct=True: dict(  # noqa: E731
      kernel="mha", workload="skew", system=system, ms=ms, correct=correct)
  rows = [row("pallas_prefill_default", 1.0), row("pallas_prefill_padded", 1.04),
          row("pallas_prefill_softcap", 1.02), row("cudnn_padded", 3.12),
          row("tokamax_mosaic", 2.6), row("torch_sdpa_cudnn", 0.5, correct=False),
          row("cudnn_packed", 0.9), row("pallas_prefill_fp8", 0.8), row("cudnn_fp8", 0.6),
          dict(row("pallas_prefill_default", 2.0), workload="other")]
  [c] = run.comparisons(rows)  # "other" has nothing to compare
  assert c["padded_vs_packed"] == pytest.approx(1.04)
  assert c["softcap_vs_nocap"] == pytest.approx(1.02)
  assert c["fp8_vs_bf16"] == pytest.approx(0.8)
  assert c["cudnn_fp8_vs_fp8"] == pytest.approx(0.75)
  name, speedup = c["anchor_vs_padded"]
  assert name == "tokamax_mosaic" and speedup == pytest.approx(2.5)  # wrong rows skipped


def _without_arrays(kind, workload):
  """A Problem with its workload and kind but no arrays: what ``useful_flops`` and a
  system's refusal read, for a workload too large to build on the CPU."""
  return sy.Problem(kind, workload, *(None,) * 5)


def test_long_context_workload_is_a_default_and_counts_its_flops(monkeypatch, tmp_path):
  """``long16384`` (issue 25): one causal 16384-token prompt, MHA and MLA, in a run without
  ``--workloads``; its useful FLOPs, counted by hand: 16384 * 16385 / 2 visible pairs,
  times 2 * heads * (qk depth + v depth), MHA 32 heads of 128 + 128, MLA 128 heads of
  192 + 128. XLA's padded call says why it cannot run it (its logits would take 32 GiB
  for MHA)."""
  cases = []
  monkeypatch.setattr(run, "run_case", lambda kind, w, *_: cases.append((kind, w.name)))
  run.main(["--systems", "pallas_prefill", "--out", str(tmp_path)])
  assert {("mha", "long16384"), ("mla", "long16384")} <= set(cases)
  w = wl.WORKLOADS["long16384"]
  assert w.q_lens == (16384,) and w.kv_lens is None and w.page_size is None
  assert w.mask == masks.CausalMask() and set(w.kernels) == {"mha", "mla"}
  pairs = 16384 * 16385 // 2
  assert wl.visible_pairs(w.q_lens, w.kv_lens, w.mask) == pairs == 134_225_920
  assert sy.useful_flops(_without_arrays("mha", w)) == 2 * 32 * (128 + 128) * pairs
  assert sy.useful_flops(_without_arrays("mla", w)) == 2 * 128 * (192 + 128) * pairs
  for kind in ("mha", "mla"):
    with pytest.raises(sy.Unavailable, match="would not fit"):
      sy.prepare("xla_padded", [_without_arrays(kind, w)])


def test_first_call_times_a_cold_trace_and_waits(monkeypatch):
  """``run.first_call``: a call whose ``prepare`` lowered it already (as
  ``systems.backend_ran`` does) is traced again, not served from JAX's caches; the backend
  an auto system's call ran is read after it, from the caches; a torch system's first
  call is waited for on its stream."""
  traces = []

  @jax.jit
  def fn(x):
    traces.append(1)
    return x * 2

  x = jnp.arange(3.0)
  sy.backend_ran(fn, x)
  assert len(traces) == 1
  prepared = sy.Prepared(fn, [(x,), (x + 1,)], lambda out: out, auto_backend=True)
  out, seconds = run.first_call(prepared)
  assert len(traces) == 2 and seconds > 0
  np.testing.assert_array_equal(out, 2 * x)  # the first input set's
  assert prepared.read_backend().backend == "auto: triton" and len(traces) == 2
  synced = []
  fake = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: synced.append(1)))
  monkeypatch.setattr(sy, "_torch", lambda: fake)
  out, seconds = run.first_call(sy.Prepared(lambda v: v + 1, [(1,)], lambda o: o,
                                            timer="torch"))
  assert out == 2 and seconds > 0 and synced == [1]


def test_comparisons_report_first_calls_and_fractions_of_the_matmul_rate():
  """Ours' first call over cuDNN's packed and padded ones, and each of our correct rows'
  useful TFLOP/s over the run's matmul rate (anchors and wrong rows left out), in
  ``comparisons`` and in results.md's tables; without a matmul rate, no fractions."""
  row = lambda system, first, tflops, correct=True, workload="long16384": dict(  # noqa: E731
      kernel="mha", workload=workload, system=system, backend="", ms=1.0, tflops=tflops,
      first_call_s=first, relerr=1e-3, correct=correct)
  rows = [row("pallas_prefill_default", 6.0, 400.0), row("pallas_prefill_mosaic", 5.0, 500.0),
          row("pallas_prefill", 9.0, 100.0, correct=False), row("cudnn_packed", 1.5, 600.0),
          row("cudnn_padded", 2.0, 550.0), row("pallas_prefill_default", 1.0, 200.0,
                                               workload="short64")]
  long, short = run.comparisons(rows, matmul_tflops=800.0)
  assert long["first_call_vs_cudnn_packed"] == pytest.approx(4.0)
  assert long["first_call_vs_cudnn_padded"] == pytest.approx(3.0)
  assert long["of_matmul"] == pytest.approx({"pallas_prefill_default": 0.5,
                                             "pallas_prefill_mosaic": 0.625})
  assert short["workload"] == "short64" and short["first_call_vs_cudnn_packed"] is None
  assert short["of_matmul"] == pytest.approx({"pallas_prefill_default": 0.25})
  [only] = run.comparisons(rows)  # no matmul rate: short64 has nothing to report
  assert only["workload"] == "long16384" and only["of_matmul"] is None
  md = run.markdown(rows, 800.0)
  assert "| mha | long16384 | - | - | - | - | - | 4.000 | 3.000 |" in md
  assert "| mha | short64 | - | - |" not in md  # no ratio for short64
  assert "`matmul_tflops`: 800.0 TFLOP/s" in md
  assert "| mha | long16384 | pallas_prefill_mosaic | 500.0 | 0.625 |" in md
  assert "| mha | short64 | pallas_prefill_default | 200.0 | 0.250 |" in md
  assert "| pallas_prefill | 100.0 |" not in md and "| cudnn_packed | 600.0 |" not in md
  assert "| mha | long16384 | cudnn_packed |  | 1.000 | 600.0 | 1.500 | 1.0e-03 | yes |" in md
  assert "of matmul" not in run.markdown(rows)


def test_tuner_parses_mosaic_configs_and_extra_workloads_run_on_request():
  from benchmarks import tune  # pylint: disable=g-import-not-at-top
  assert tune.mosaic_config("128x2") == pp.MosaicConfig(block_kv=128, num_stages=2)
  assert tune.mosaic_config("64X3") == pp.MosaicConfig(block_kv=64, num_stages=3)
  with pytest.raises(ValueError):
    tune.mosaic_config("64x1")  # MosaicConfig's own check: at least two stages
  for name in wl.EXTRA:
    assert name in wl.WORKLOADS and name not in run.DEFAULT_WORKLOADS
    w = wl.WORKLOADS[name]
    assert w.page_size and len(w.kv_lens) == len(w.q_lens)
    assert all(k >= q for q, k in zip(w.q_lens, w.kv_lens))


def test_tuner_writes_a_table_config_reads(tmp_path):
  import runpy

  from benchmarks import tune
  from pallas_prefill import tuned

  table = {k: dict(v) for k, v in tuned.TUNED.items()}
  table.setdefault("Some GPU", {})[(128, 128, "float16", "NullMask", True)] = (128, 64, 8, 3)
  path = tmp_path / "tuned.py"
  tune.write_table(path, table)
  assert runpy.run_path(str(path))["TUNED"] == table


def _call_once(fn, arg_sets, **_):
  """``run.bench_jax`` for the CPU tests: one call, a nominal millisecond."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*arg_sets[0]))
  return 1e-3


def test_scaling_measures_a_head_sharded_call(monkeypatch):
  """benchmarks.scaling on 2 of the 4 host devices (interpret mode): the sharded call is
  correct, keeps the head sharding and compiles without a collective. (Timing is the
  harness's; one call each keeps this quick.)"""
  from benchmarks import scaling

  monkeypatch.setattr(run, "bench_jax", _call_once)
  row = scaling.measure("mha", wl.WORKLOADS["tiny"], 2)
  assert row["correct"] and row["relerr_sharded"] < run.TOLERANCE
  assert row["collectives"] == []
  assert "heads" in row["out_sharding"]


def test_harness_rounds_take_turns_after_a_rest(monkeypatch, tmp_path):
  """``--rounds 3 --rest R``: every system timed three times in turns (A B A B A B), each
  timing after a rest of R seconds, and a row's time the median of its rounds."""
  events = []
  times = iter([1.0, 5e-3, 1e-3, 4e-3, 2e-3, 3e-3, 9e-3])  # the matmul, A, B, A, B, A, B

  def bench(*_, **__):
    events.append(("bench", None))
    return next(times)

  monkeypatch.setattr(run, "bench_jax", bench)
  monkeypatch.setattr(run.time, "sleep", lambda s: events.append(("rest", s)))
  run.main(["--kernels", "mha", "--workloads", "tiny", "--systems", "pallas_prefill",
            "xla_padded", "--rounds", "3", "--rest", "0.25", "--out", str(tmp_path)])
  assert [e[0] for e in events] == ["bench"] + ["rest", "bench"] * 6  # the matmul first
  assert {e[1] for e in events if e[0] == "rest"} == {0.25}
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["meta"]["rounds"] == 3 and results["meta"]["rest_s"] == 0.25
  got = {r["system"]: r for r in results["rows"]}
  assert got["pallas_prefill"]["ms_rounds"] == pytest.approx([5, 4, 3])
  assert got["pallas_prefill"]["ms"] == pytest.approx(4)
  assert got["xla_padded"]["ms_rounds"] == pytest.approx([1, 2, 9])
  assert got["xla_padded"]["ms"] == pytest.approx(2)
  assert all(r["correct"] for r in got.values())


def test_timers_runs_every_method_in_turns(tmp_path):
  """benchmarks.experiments.timers on the CPU (no nvidia-smi: no clock readings): both JAX
  methods for a JAX system, every round."""
  from benchmarks.experiments import timers

  timers.main(["--workloads", "tiny", "--systems", "xla_padded", "--rest", "0",
               "--rounds", "2", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "timers.json").read_text())["rows"]
  assert [(r["method"], r["round"]) for r in rows] == [
      ("stream", 0), ("stream_x4", 0), ("stream", 1), ("stream_x4", 1)]
  assert all(r["ms"] > 0 and r["sm_mhz"] is None for r in rows)


def test_lowering_time_times_both_backends(capsys):
  """benchmarks.experiments.lowering_time at a small size: a row of trace and lowering
  seconds per backend and repeat, and the profile's table when asked for."""
  from benchmarks.experiments import lowering_time

  lowering_time.main(["--total-q", "300", "--max-prompt-len", "256", "--repeats", "1",
                      "--profile", "3"])
  out = capsys.readouterr().out
  rows = [line.split("|")[1:-1] for line in out.splitlines()
          if line.startswith("| mosaic_gpu") or line.startswith("| triton")]
  assert [(r[0].strip(), r[1].strip()) for r in rows] == [("mosaic_gpu", "0"), ("triton", "0")]
  assert all(float(x) > 0 for r in rows for x in r[2:])
  assert "cumulative" in out


def test_torch_systems_are_waited_for_on_their_stream(monkeypatch):
  """``Prepared.wait`` for a torch system synchronizes torch's device (JAX's
  ``block_until_ready`` does not wait for it), and ``run.bench_jax`` waits that way at
  the warm-up and at the end of every round when given it."""
  synced = []
  fake = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: synced.append(1)))
  monkeypatch.setattr(sy, "_torch", lambda: fake)
  prepared = sy.Prepared(lambda x: x, [(1,), (2,)], lambda out: out, timer="torch")
  run.bench_jax(prepared.fn, prepared.arg_sets, rounds=3, reps=4, wait=prepared.wait)
  assert len(synced) == 2 + 3  # one per input set's warm-up call, one per round


def test_commit_prefers_the_environment(monkeypatch):
  monkeypatch.setenv("PALLAS_PREFILL_COMMIT", "abc1234")
  assert run.commit() == "abc1234"


def test_layers_counts_kernels_and_shares_offsets(monkeypatch):
  """benchmarks.experiments.layers in interpret mode: L layers' calls under one jit give each
  layer's single-call output, and the kernel counts come from the compiled entry
  computation."""
  from benchmarks.experiments import layers

  monkeypatch.setattr(run, "bench_jax", _call_once)
  row = layers.measure("mha", wl.WORKLOADS["tiny"], 2, "triton")
  assert row["same_outputs"]
  assert 0 < row["kernels_one_call"] <= row["kernels_all_layers"]
  hlo = "\n".join([
      "HloModule m", "%fused (p: f32[2]) -> f32[2] {", "  %p = f32[2] parameter(0)", "}",
      "ENTRY %main (a: f32[2]) -> (f32[2], f32[2]) {",
      "  %a = f32[2]{0} parameter(0)",
      "  %f = f32[2]{0} fusion(f32[2]{0} %a), kind=kLoop, calls=%fused",
      "  %c = f32[2]{0} custom-call(f32[2]{0} %f), custom_call_target=\"x\"",
      "  ROOT %t = (f32[2]{0}, f32[2]{0}) tuple(%f, %c)", "}"])
  assert layers.count_kernels(hlo) == 2


def _fake_kernel(monkeypatch, seen):
  """``pp.mha_prefill`` replaced by the reference, recording each call's backend and config:
  what our systems would run, on the CPU, where the Mosaic GPU backend cannot."""
  def kernel(*args, config, backend="auto", **kwargs):
    seen.append((backend, config))
    return pp.reference.mha_prefill_reference(*args, **kwargs)

  monkeypatch.setattr(pp, "mha_prefill", kernel)


def test_harness_passes_mosaic_options_to_the_mosaic_system_only(monkeypatch, tmp_path):
  """``--mosaic-options``: the Mosaic GPU system passes the call's default config with the
  given MosaicConfig fields and MosaicOptions, and so does the soft-capped one; the Triton
  system passes none; the options are in the results' meta. Without them, config=None."""
  seen = []
  _fake_kernel(monkeypatch, seen)
  run.main(["--kernels", "mha", "--workloads", "tiny", "--systems", "pallas_prefill_mosaic",
            "pallas_prefill", "pallas_prefill_softcap", "--mosaic-options", "dynamic=False",
            "block_kv=64", "head_major=1", "--out", str(tmp_path)])
  w = wl.WORKLOADS["tiny"]
  default = config_lib.default_mosaic_config(128, 128, "bfloat16", w.mask, w.max_len)
  assert default.block_kv == 128  # so that block_kv=64 is seen to change it
  # (the options the call's default has, column_mask among them, kept unless given)
  expected = pp.MosaicConfig(block_kv=64, num_stages=default.num_stages,
                             options=dataclasses.replace(default.options, dynamic=False,
                                                         head_major=1))
  # The soft-capped system (no backend argument) takes the config too.
  assert set(seen) == {("mosaic_gpu", expected), ("triton", None), ("auto", expected)}
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["meta"]["mosaic_options"] == {"dynamic": False, "block_kv": 64,
                                               "head_major": 1}
  assert all(r["correct"] for r in results["rows"]) and len(results["rows"]) == 3
  seen.clear()
  run.main(["--kernels", "mha", "--workloads", "tiny", "--systems", "pallas_prefill_mosaic",
            "--out", str(tmp_path)])
  assert set(seen) == {("mosaic_gpu", None)}


def test_mosaic_options_parse_literals_and_refuse_what_is_not_an_option():
  assert sy.parse_mosaic_options(["split_units=True", "num_programs=None", "deal=0"]) == {
      "split_units": True, "num_programs": None, "deal": 0}
  assert sy.parse_mosaic_options([]) == {}
  for setting, says in [("NOPE=1", "NAME one of dynamic"), ("DYNAMIC=False", "NAME one of"),
                        ("dynamic", "NAME=VALUE"), ("dynamic=maybe", "not a Python literal"),
                        ("dynamic=1", "must be a bool"), ("head_major=True", "None, 0 or 1"),
                        ("block_kv=32", "64, 128 or"), ("num_stages=1", ">= 2")]:
    with pytest.raises(ValueError, match=says):
      sy.parse_mosaic_options([setting])


def test_profile_runs_one_call(monkeypatch, capsys):
  """benchmarks.profile prepares a harness system with its options and calls it (on the
  CPU, with no CUDA runtime to start a profiler, unprofiled, and it says so)."""
  from benchmarks import profile

  seen, calls = [], []
  _fake_kernel(monkeypatch, seen)
  real = sy.SYSTEMS["pallas_prefill_mosaic"]

  def counted(problems, mosaic_options=None):
    prepared = real(problems, mosaic_options)
    fn = prepared.fn
    prepared.fn = lambda *a: calls.append(1) or fn(*a)
    return prepared

  monkeypatch.setitem(sy.SYSTEMS, "pallas_prefill_mosaic", counted)
  monkeypatch.setattr(profile, "_cudart", lambda: None)
  profile.main(["--kernel", "mha", "--workload", "tiny", "--system", "pallas_prefill_mosaic",
                "--mosaic-options", "dynamic=False"])
  assert len(calls) == 4  # three to compile and warm up, one profiled
  [(backend, config)] = seen  # traced once
  # (the options config=None has for tiny's short prompts, dynamic replaced)
  w = wl.WORKLOADS["tiny"]
  default = config_lib.default_mosaic_config(128, 128, "bfloat16", w.mask, w.max_len)
  assert default.options.column_mask and default.options.dynamic
  assert backend == "mosaic_gpu" and config.options == dataclasses.replace(
      default.options, dynamic=False)
  assert ("unprofiled) one call: mha tiny pallas_prefill_mosaic {'dynamic': False}"
          in capsys.readouterr().out)
  with pytest.raises(SystemExit):  # not an option
    profile.main(["--mosaic-options", "DYNAMIC=False"])


def test_ab_runs_the_arms_in_turn_and_takes_medians(monkeypatch, tmp_path, capsys):
  from benchmarks import ab  # pylint: disable=g-import-not-at-top
  calls = []

  def fake_arm(options, harness_args, out):
    calls.append((dict(options), os.path.basename(out)))
    tflops = {True: [100.0, 110.0, 300.0], False: [50.0, 70.0, 1.0]}[options["dynamic"]]
    os.makedirs(out)
    with open(os.path.join(out, "results.json"), "w") as f:
      json.dump(dict(meta={}, rows=[dict(kernel="mha", workload="tiny", system=s,
                                         tflops=tflops[int(out[-1])], correct=True)
                                    for s in harness_args[1:]]), f)

  monkeypatch.setattr(ab, "run_arm", fake_arm)
  ab.main(["--arm", "dyn", "dynamic=True", "fold_scale=False", "--arm", "static",
           "dynamic=False", "--rounds", "3", "--out", str(tmp_path), "--", "--systems",
           "pallas_prefill_mosaic"])
  assert [name for _, name in calls] == ["dyn-r0", "static-r0", "dyn-r1", "static-r1",
                                          "dyn-r2", "static-r2"]
  assert calls[0][0] == {"dynamic": True, "fold_scale": False}
  assert "| mha | tiny | pallas_prefill_mosaic | 110.0 | 50.0 | 0.455 |" in (
      capsys.readouterr().out)
  results = json.loads((tmp_path / "ab.json").read_text())
  assert results["arms"] == {"dyn": {"dynamic": True, "fold_scale": False},
                             "static": {"dynamic": False}}
  [row] = results["rows"]
  assert row["tflops"] == {"dyn": 110.0, "static": 50.0}
  assert row["correct"] == {"dyn": True, "static": True}


@pytest.mark.parametrize("argv", [
    ["--arm", "a", "NOPE=1"], ["--arm", "a", "DYNAMIC=False"], ["--arm", "a", "dynamic=1"],
    ["--arm", "a", "dynamic"], ["--arm", "a", "dynamic=maybe"], ["--arm", "a=1"],
    ["--arm", "a", "--arm", "a"], ["--arm", "a", "--", "--mosaic-options", "dynamic=False"],
    ["--arm", "a", "--", "--out", "x"]])
def test_ab_refuses_what_is_not_an_arm(argv, monkeypatch):
  from benchmarks import ab  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(ab, "run_arm", lambda *_: pytest.fail("an arm ran"))
  with pytest.raises(SystemExit):
    ab.main(argv)


def test_ab_child_process_runs_the_harness_with_the_arms_options(tmp_path):
  """One real arm on the CPU: the child is the harness with the arm's options (recorded in
  its results), here on the Triton system in interpret mode on the tiny workload."""
  from benchmarks import ab  # pylint: disable=g-import-not-at-top
  ab.main(["--arm", "static", "dynamic=False", "num_programs=None", "--rounds", "1", "--out",
           str(tmp_path), "--", "--kernels", "mha", "--workloads", "tiny", "--systems",
           "pallas_prefill"])
  results = json.loads((tmp_path / "static-r0" / "results.json").read_text())
  assert results["meta"]["mosaic_options"] == {"dynamic": False, "num_programs": None}
  [row] = results["rows"]
  assert row["system"] == "pallas_prefill" and row["correct"]
  assert json.loads((tmp_path / "ab.json").read_text())["arms"] == {
      "static": {"dynamic": False, "num_programs": None}}


# --------------------------------------------------------------------------------------
# FP8 (issue 24): the *_fp8 systems quantize the workload's data themselves


def test_fp8_problems_are_quantized_per_kv_head_or_per_tensor():
  """``quantize_problem``: e4m3 arrays whose dequantized values lie within e4m3's
  precision of the data, scales per K/V head (Q's per K/V head's group of query heads) or
  per tensor; the paged cache quantized with the packed K/V's scales; MLA's k_nope and
  k_rope under one per-tensor k_scale."""
  e4 = jnp.dtype(jnp.float8_e4m3fn)
  problem = sy.make_problem("mha", wl.WORKLOADS["tiny_paged"], 0)
  kv_heads = problem.kv[0].shape[1]
  for per_tensor in (False, True):
    quantized = sy.quantize_problem(problem, per_tensor=per_tensor)
    p8 = quantized.problem
    assert {x.dtype for x in (p8.q, *p8.kv, *(x.pages for x in p8.paged))} == {e4}
    assert {s.shape for s in quantized.scales.values()} == {() if per_tensor else (kv_heads,)}
    dequantized = quantized.dequantized()
    assert dequantized.paged is None and dequantized.q.dtype == jnp.float32
    for approx, x in zip((dequantized.q, *dequantized.kv), (problem.q, *problem.kv)):
      assert run.rel_err(approx, x) < 4e-2
    k_pages = p8.paged[0]
    assert float(jnp.abs(k_pages.pages.astype(jnp.float32)).max()) == float(
        jnp.abs(p8.kv[0].astype(jnp.float32)).max())  # the same values, paged
  group = problem.q.shape[1] // kv_heads
  q_scale = sy.quantize_problem(problem).scales["q_scale"]
  top = jnp.abs(problem.q.astype(jnp.float32)).reshape(-1, kv_heads, group, 128).max((0, 2, 3))
  np.testing.assert_allclose(q_scale, top / 448, rtol=1e-6)
  mla = sy.quantize_problem(sy.make_problem("mla", wl.WORKLOADS["tiny"], 0))
  assert mla.scales["k_scale"].shape == () and mla.scales["q_scale"].shape == (128,)
  assert {x.dtype for x in mla.problem.kv} == {e4}


def test_fp8_systems_run_beside_bf16_and_are_checked_against_the_dequantized_inputs(
    monkeypatch, tmp_path, capsys):
  """``--systems pallas_prefill_default pallas_prefill_fp8 pallas_prefill_padded_fp8
  cudnn_fp8`` in one run (MHA ``tiny``, interpret mode): the FP8 rows (packed, and padded
  through ``dot_product_attention``) are correct within FP8_TOLERANCE against the
  reference of their dequantized inputs (which differs from the bf16 inputs' reference
  by far more than their error), record their tolerance, and the ratio FP8 / bf16 is
  reported; cuDNN's FP8 says why it cannot run the ragged batch."""
  monkeypatch.setattr(run, "bench_jax", _call_once)
  run.main(["--kernels", "mha", "--workloads", "tiny", "--systems", "pallas_prefill_default",
            "pallas_prefill_fp8", "pallas_prefill_padded_fp8", "cudnn_fp8", "--out",
            str(tmp_path)])
  assert any("cudnn_fp8" in line and "n/a: equal lengths only" in line
             for line in capsys.readouterr().out.splitlines())
  got = {r["system"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
  assert set(got) == {"pallas_prefill_default", "pallas_prefill_fp8",
                      "pallas_prefill_padded_fp8"}
  problem = sy.make_problem("mha", wl.WORKLOADS["tiny"], 0)
  dequantized = sy.quantize_problem(problem).dequantized()
  for name in ("pallas_prefill_fp8", "pallas_prefill_padded_fp8"):
    fp8_row = got[name]
    assert fp8_row["correct"] and fp8_row["tolerance"] == sy.FP8_TOLERANCE
    assert fp8_row["backend"] == "auto: triton"
    assert run.rel_err(sy.reference(problem), sy.reference(dequantized)) > (
        5 * fp8_row["relerr"])
  assert "tolerance" not in got["pallas_prefill_default"]
  assert "| mha | tiny | - | - | 1.000 | - | - | - | - |" in (
      tmp_path / "results.md").read_text()


def test_fp8_systems_run_on_paged_workloads(monkeypatch, tmp_path):
  """pallas_prefill_fp8 on a paged workload (MHA and MLA ``tiny_paged``, interpret mode)
  runs on its FP8 pages, correct within FP8_TOLERANCE beside the bf16 row."""
  monkeypatch.setattr(run, "bench_jax", _call_once)
  run.main(["--kernels", "mha", "mla", "--workloads", "tiny_paged", "--systems",
            "pallas_prefill_default", "pallas_prefill_fp8", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  got = {(r["kernel"], r["system"]): r for r in rows}
  assert set(got) == {(k, s) for k in ("mha", "mla")
                      for s in ("pallas_prefill_default", "pallas_prefill_fp8")}
  for kind in ("mha", "mla"):
    fp8_row = got[kind, "pallas_prefill_fp8"]
    assert fp8_row["correct"] and fp8_row["relerr"] < sy.FP8_TOLERANCE, fp8_row
  problem = sy.make_problem("mha", wl.WORKLOADS["tiny_paged"], 0)
  prepared = sy.prepare("pallas_prefill_fp8", [problem])
  kv = prepared.arg_sets[0][1]
  assert all(isinstance(x, pp.PagedKV) and x.dtype == jnp.float8_e4m3fn for x in kv)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_fp8_paged_workload_runs_mosaic_gpu_on_an_h200(kind):
  """The FP8 chunked paged workload (``chunked8x512_page64``, issue 24's "at least 1.4x
  our bf16 paged"): the call pallas_prefill_fp8 times (its problem quantized by
  ``quantize_problem``, "auto"), lowered for an H200, runs the Mosaic GPU kernel on the
  FP8 pages in place (``config.prefers_triton``), beside the small Triton-lowered kernel
  of V^T (``operands.transposed_v_pages``). (The system's own jitted call picks
  interpret mode on the CPU.)"""
  # pylint: disable-next=g-import-not-at-top
  from tests.test_lowering import lower_for_h200, triton_calls
  workload = wl.WORKLOADS["chunked8x512_page64"]
  quantized = sy.quantize_problem(sy.make_problem(kind, workload, 0))
  p8 = quantized.problem
  kernel = pp.mha_prefill if kind == "mha" else pp.mla_prefill

  def fn(q, kv, q_off, scales):
    return kernel(q, *kv, q_off, max_prompt_len=workload.max_len, mask=workload.mask,
                  interpret=False, **scales)

  args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      (p8.q, p8.paged, p8.q_offsets, quantized.scales))
  assert {x.dtype for x in args[1]} == {jnp.dtype(sy.FP8_DTYPE)}
  lowered = lower_for_h200(fn, *args)
  assert "custom_call @mosaic_gpu" in lowered.as_text()
  assert [c.name for c in triton_calls(lowered)] == ["fp8_v_transposed"]


def test_fp8_on_mla_is_not_run_where_mla_prefill_refuses_it(monkeypatch):
  """Where ``mla_prefill`` refuses FP8 inputs, pallas_prefill_fp8 on MLA is not run (with
  the reason), not a failure; on MHA the same error is one."""
  def refuse(*_, **__):
    raise TypeError("mla_prefill takes no FP8 inputs")

  monkeypatch.setattr(pp, "mla_prefill", refuse)
  monkeypatch.setattr(pp, "mha_prefill", refuse)
  with pytest.raises(sy.Unavailable, match="mla_prefill refuses FP8 inputs: TypeError"):
    sy.prepare("pallas_prefill_fp8", [sy.make_problem("mla", wl.WORKLOADS["tiny"], 0)])
  with pytest.raises(TypeError):
    sy.prepare("pallas_prefill_fp8", [sy.make_problem("mha", wl.WORKLOADS["tiny"], 0)])


EQUAL = wl.Workload("equal2x128", (128, 128), kernels=("mha",))


@pytest.mark.parametrize("kind,workload,reason", [
    ("mha", wl.WORKLOADS["tiny"], "equal lengths only"),
    ("mha", wl.WORKLOADS["tiny_paged"], "self-attention only"),
    ("mha", dataclasses.replace(EQUAL, mask=masks.SlidingWindowCausalMask(16)),
     "causal or no mask only"),
    ("mla", dataclasses.replace(EQUAL, kernels=("mla",)), "MHA only"),
    ("mha", EQUAL, "needs a GPU"),  # expressible: the CPU is what stops it
])
def test_cudnn_fp8_says_where_it_cannot_run(kind, workload, reason):
  problems = [sy.make_problem(kind, workload, 0)]
  for name in ("cudnn_fp8", "cudnn_fp8_kv_repeated"):
    with pytest.raises(sy.Unavailable, match=reason):
      sy.prepare(name, problems)


def test_cudnn_fp8_inputs_and_call_lower_for_cuda(monkeypatch):
  """cuDNN's FP8 inputs: the packed rows as dense [batch, len, heads, 128] e4m3 arrays
  (K/V at 8 heads, or repeated to 32), per-tensor fp8_params with every key JAX checks;
  the call lowers (for CUDA, on the CPU, its cuDNN version check stubbed) to cuDNN's FP8
  custom call with GQA's 8 K/V heads and an e4m3 output."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

  quantized = sy.quantize_problem(sy.make_problem("mha", EQUAL, 0), per_tensor=True)
  q, k, v, params = sy.cudnn_fp8_inputs(quantized)
  assert q.shape == (2, 128, 32, 128) and k.shape == v.shape == (2, 128, 8, 128)
  assert q.dtype == k.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(q.reshape(-1, 32, 128).astype(jnp.float32),
                                quantized.problem.q.astype(jnp.float32))
  assert set(params) == set(fa.fp8_params_keys)
  assert {x.shape for x in params.values()} == {(1, 1, 1, 1)}
  assert float(params["descale_q"][0, 0, 0, 0]) == float(quantized.scales["q_scale"])
  assert float(params["scale_o"][0, 0, 0, 0] * quantized.scales["v_scale"]) == (
      pytest.approx(1.0))
  assert sy.cudnn_fp8_inputs(quantized, repeat_kv=True)[1].shape == (2, 128, 32, 128)
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91900)
  fn = jax.jit(lambda q, k, v, p: sy.cudnn_fp8_attention(q, k, v, p, causal=True))
  text = fn.trace(q, k, v, params).lower(lowering_platforms=("cuda",)).as_text()
  call = next(line for line in text.splitlines() if "__cudnn$fmhaSoftmaxF8" in line)
  assert "tensor<2x128x8x128xf8E4M3FN>" in call and "tensor<2x32x128x128xf8E4M3FN>" in call


def test_cudnn_fp8_output_is_dequantized_with_its_scale(monkeypatch):
  """The cuDNN FP8 system's bookkeeping, with cuDNN's documented semantics emulated on the
  CPU (logits = q8.k8 descale_q descale_k scale, out8 = softmax . v8 descale_v scale_o in
  e4m3): its packed output matches the dequantized inputs' reference within
  FP8_TOLERANCE."""
  def emulated(q, k, v, params, *, causal):
    f = lambda x, key: x.astype(jnp.float32) * params[key][0, 0, 0, 0]  # noqa: E731
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (f(k, "descale_k"), f(v, "descale_v")))
    logits = jnp.einsum("bqhd,bkhd->bhqk", f(q, "descale_q"), k) * q.shape[-1] ** -0.5
    length = q.shape[1]
    visible = jnp.tril(jnp.ones((length, length), bool)) if causal else True
    probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v) * params["scale_o"][0, 0, 0, 0]
    return out.astype(q.dtype)

  monkeypatch.setattr(sy, "cudnn_fp8_attention", emulated)
  monkeypatch.setattr(sy.jax, "default_backend", lambda: "gpu")
  prepared = sy.prepare("cudnn_fp8", [sy.make_problem("mha", EQUAL, s) for s in range(2)])
  assert prepared.tolerance == sy.FP8_TOLERANCE
  err = run.rel_err(prepared.to_packed(prepared.fn(*prepared.arg_sets[0])),
                    prepared.reference())
  assert 1e-3 < err < sy.FP8_TOLERANCE  # e4m3's output rounding, about 3e-2


def test_fp8_accuracy_experiment_runs_in_interpret_mode(tmp_path, capsys):
  """benchmarks.experiments.fp8_accuracy on the CPU at a tiny size, the Triton backend
  named (``auto`` lowers each call once more to say what it picked): ours on bf16,
  per-head and per-tensor FP8 inputs and a bf16 q over per-head FP8 K/V, for normal and
  outlier data, cuDNN skipped with a message; the FP8 errors against the dequantized
  inputs' reference within FP8_TOLERANCE, and the outliers' against the original data
  far larger than normal data's."""
  from benchmarks.experiments import fp8_accuracy  # pylint: disable=g-import-not-at-top

  fp8_accuracy.main(["--interpret", "--lens", "16", "9", "--heads", "2", "--kv-heads", "1",
                     "--head-dim", "32", "--backend", "triton", "--out", str(tmp_path)])
  assert "cudnn: skipped (needs a GPU)" in capsys.readouterr().out
  rows = json.loads((tmp_path / "fp8_accuracy.json").read_text())["rows"]
  got = {(r["data"], r["quantization"], r["system"]): r for r in rows}
  assert set(got) == {(d, q, "pallas_prefill") for d in ("normal", "outliers")
                      for q in ("none (bf16)", "per_head", "per_tensor")} | {
                          (d, "per_head", "pallas_prefill bf16 q")
                          for d in ("normal", "outliers")}
  for (data, quantization, _), r in got.items():
    assert r["backend"] == "triton"
    if quantization != "none (bf16)":
      assert r["err_dequantized"] < sy.FP8_TOLERANCE, (data, quantization)
  assert (got[("outliers", "per_head", "pallas_prefill")]["err_original"]
          > 2 * got[("normal", "per_head", "pallas_prefill")]["err_original"])


def test_compute_wgs_experiment_lowers_every_arm(capsys):
  """benchmarks.experiments.compute_wgs's kernel (two or three compute warpgroups, bf16
  and FP8, the ring of turns or none) lowers for an H200 in every arm, at a small size."""
  from benchmarks.experiments import compute_wgs  # pylint: disable=g-import-not-at-top
  compute_wgs.main(["--lower", "--seq", "768"])
  out = capsys.readouterr().out
  for arm in compute_wgs.ARMS:
    assert f"{arm.name}: lowered" in out, arm


def test_ptx_pressure_reads_loops(tmp_path, capsys):
  """benchmarks.experiments.ptx_pressure on a small PTX loop (an invariant, a 64-bit
  invariant, a carried value, values defined inside) and a SASS loop."""
  from benchmarks.experiments import ptx_pressure  # pylint: disable=g-import-not-at-top
  ptx = "\n".join([
      "mov.b32 \t%r1, 5;", "mov.b64 \t%rd1, 7;", "mov.b32 \t%r2, 0;", "$L__BB0_1:",
      "add.s32 \t%r3, %r2, %r1;", "add.s32 \t%r2, %r3, 1;", "add.s64 \t%rd2, %rd1, 1;",
      "setp.lt.s32 \t%p1, %r2, 10;", "@%p1 bra \t$L__BB0_1;", "ret;"])
  [loop] = ptx_pressure.ptx_loops(ptx)
  assert (loop.first, loop.last) == (3, 8)
  assert sorted(loop.live_in) == [("r", "1"), ("r", "2"), ("rd", "1")]
  assert (loop.peak, loop.peak_line) == (6, 6)  # r1, r2, rd1 all through, rd2 at its line
  invariant = dict(ptx_pressure.invariant_live_ins(ptx, loop))
  assert set(invariant) == {("r", "1"), ("rd", "1")}
  assert invariant[("rd", "1")].startswith("mov.b64")
  sass = "\n".join([
      ".L_x_0:",
      "        /*0010*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT, gsb0 ;",
      "        /*0020*/   MUFU.EX2 R13, R56 ;",
      "        /*0030*/   STL [R1], R2 ;",
      "        /*0040*/   @P2 BRA `(.L_x_0) ;",
      "        /*0050*/   EXIT ;"])
  assert ptx_pressure.sass_loops(sass) == [dict(start=0x10, end=0x40, instructions=4,
                                                gmma=1, ex2=1, stl=1, ldl=0)]
  (tmp_path / "k.ptx").write_text(ptx)
  (tmp_path / "k.sass").write_text(sass)
  ptx_pressure.main([str(tmp_path / "k.ptx"), "--loop", "0", "--sass",
                     str(tmp_path / "k.sass")])
  out = capsys.readouterr().out
  assert "live-in 4 registers, peak about 6" in out and "%rd1: mov.b64" in out


def test_ncu_summary_reads_a_raw_csv(tmp_path, capsys):
  """benchmarks.experiments.ncu_summary on an ncu raw page (its own lines first, a units
  row after the header): every kernel's duration, then the longest kernel's wanted
  nonzero metrics only."""
  from benchmarks.experiments import ncu_summary  # pylint: disable=g-import-not-at-top
  path = tmp_path / "a.csv"
  path.write_text(
      "==PROF== Connected to process 1\n"
      '"ID","Kernel Name","gpu__time_duration.sum","smsp__issue_active.avg.pct",'
      '"sm__inst_executed_pipe_xu.avg.pct","sm__inst_executed_pipe_fma.avg.pct",'
      '"dram__bytes.sum"\n'
      '"","","nsecond","%","%","%","byte"\n'
      '"0","work_items","9,152","10.5","0","1.0","5"\n'
      '"1","attention","937,664","41.9","34.3","0","7"\n')
  ncu_summary.main([str(path)])
  out = capsys.readouterr().out.splitlines()
  assert out[1:4] == ["- work_items: 9,152", "- attention: 937,664", "longest: attention"]
  assert out[4:] == ["  gpu__time_duration.sum = 937,664",
                     "  smsp__issue_active.avg.pct = 41.9",
                     "  sm__inst_executed_pipe_xu.avg.pct = 34.3"]


def test_ncu_source_summary_reads_a_source_page(tmp_path, capsys):
  """benchmarks.experiments.ncu_source_summary on a gzipped ncu source page (ncu's own
  lines first, a work-list kernel before the attention kernel): the last Mosaic GPU
  kernel's samples by reason and opcode (predicates and modifiers dropped), its hottest
  instruction first; ``--kernel 0`` the first's (the work list's)."""
  import gzip  # pylint: disable=g-import-not-at-top
  from benchmarks.experiments import ncu_source_summary  # pylint: disable=g-import-not-at-top
  header = ('"Address","Source","Warp Stall Sampling (All Samples)",'
            '"Instructions Executed","stall_long_sb","stall_wait"\n')
  text = ("==PROF== Connected to process 1\n"
          '"Kernel Name","anonymous_mosaic_gpu_kernel",\n' + header
          + '"0x10","LDG.E R1, [R2]","99","4","99","0"\n'
          '"Kernel Name","anonymous_mosaic_gpu_kernel",\n' + header
          + '"0x7f00000a0","@!P2  BRA 0x7f00000b0","5","8","5","0"\n'
          '"0x7f00000b0","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","7","8","0","7"\n'
          '"0x7f00000c0","@P0   BRA.U 0x7f00000a0","1","8","0","1"\n')
  path = tmp_path / "src.csv.gz"
  with gzip.open(path, "wt") as f:
    f.write(text)
  ncu_source_summary.main([str(path), "--top", "1"])
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith(": 13 samples, 3 instructions"), out
  assert out[1] == "  by reason: wait 8, long_sb 5", out
  assert out[2] == "  by opcode: HGMMA 7, BRA 6", out
  assert out[3].startswith("  000b0      7 samples, long_sb     0, executed        8: HGMMA"), out
  assert len(out) == 4
  ncu_source_summary.main([str(path), "--top", "1", "--kernel", "0"])  # the work list's
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith("Mosaic GPU kernel 0 of 2: 99 samples, 1 instructions"), out
  assert out[1] == "  by reason: long_sb 99, wait 0", out
  ncu_source_summary.main([str(path), "--kernel", "2"])
  assert capsys.readouterr().out.strip().endswith("2 Mosaic GPU kernels, no kernel 2")


def test_arms_experiment_times_arms_in_turns(tmp_path, monkeypatch, capsys):
  """benchmarks.experiments.arms with stand-in systems: each (system, arm) prepared with
  the arm's options, checked once, timed in turns every round; the table's ratios are to
  the first arm of the same system and, for the padded system, to the packed one in the
  same arm; bad arms are refused."""
  from benchmarks.experiments import arms

  asked, timed = [], []
  secs = {("pallas_prefill_mosaic", "new"): 1.0, ("pallas_prefill_mosaic", "old"): 1.1,
          ("pallas_prefill_padded", "new"): 1.02, ("pallas_prefill_padded", "old"): 1.32}

  def fake_prepare(name, problems, mosaic_options):
    key = (name, "old" if mosaic_options.get("keyless_units") == "per_head" else "new")
    asked.append(key)
    out = jnp.ones((3,), jnp.float32)
    return sy.Prepared(lambda *a: out, [key], lambda o: o)

  def fake_bench(fn, arg_sets):
    timed.append(arg_sets[0])
    return secs[arg_sets[0]]

  monkeypatch.setattr(sy, "prepare", fake_prepare)
  monkeypatch.setattr(sy, "reference", lambda p: jnp.ones((3,)) * 1.01)
  monkeypatch.setattr(arms.run, "bench_jax", fake_bench)
  rows = arms.main(["--arm", "new", "--arm", "old", "keyless_units='per_head'",
                    "--workloads", "tiny", "--rounds", "2", "--rest", "0",
                    "--out", str(tmp_path)])
  assert asked == list(secs)
  assert timed == list(secs) * 2  # in turns, every round
  by = {(r["system"], r["arm"]): r for r in rows}
  assert by["pallas_prefill_mosaic", "old"]["tflops"] == pytest.approx(
      by["pallas_prefill_mosaic", "new"]["tflops"] / 1.1)
  assert by["pallas_prefill_padded", "new"]["err"] == pytest.approx(0.01 / 1.01, rel=1e-4)
  table = capsys.readouterr().out
  assert "| old | " in table and "0.909x" in table  # old against new: 1.0 / 1.1
  assert "1.020x" in table and "1.200x" in table  # padded time / packed, per arm
  saved = json.loads((tmp_path / "arms.json").read_text())
  assert saved["arms"] == {"new": {}, "old": {"keyless_units": "per_head"}}
  for bad in (["--arm", "a", "--arm", "a"], ["--arm", "x=1"],
              ["--arm", "a", "nonsense=1"]):
    with pytest.raises(SystemExit):
      arms.main(bad)


def test_three_wgs_bits_experiment_compares_two_and_three(monkeypatch, tmp_path, capsys):
  """benchmarks.experiments.three_wgs_bits with a stand-in entry point (the Mosaic GPU
  kernel needs a Hopper GPU): both calls take the register cuts and differ only in
  compute_wgs; the same bits pass, one element changed with three warpgroups is reported
  and exits 1; the cases lower for an H200 (two small ones here)."""
  from benchmarks.experiments import three_wgs_bits as tb  # pylint: disable=g-import-not-at-top
  from tests import cases, test_gpu  # pylint: disable=g-import-not-at-top
  tiny = cases.Case(lens=(37, 1, 100), heads=4, kv_heads=2, head_dim=128, config=None,
                    lse=True)
  monkeypatch.setattr(tb, "case_list", lambda: [
      tiny, dataclasses.replace(tiny, kv_lens=(50, 1, 130), page_size=16)])
  monkeypatch.setattr(test_gpu, "poison_device_memory", lambda: None)
  seen, change = [], []

  def entry(*args, interpret, backend, config, **kwargs):
    seen.append((interpret, backend, config))
    out, lse = pp.reference.mha_prefill_reference(*args, **kwargs)
    if change and config.compute_wgs == 3:
      out = out.at[0, 0, 0].add(0.25)
    return out, lse

  monkeypatch.setitem(cases.ENTRY_POINTS, "mha",
                      (entry, pp.reference.mha_prefill_reference))
  assert tb.main(["--out", str(tmp_path)]) == 0
  assert [c.compute_wgs for _, _, c in seen] == [2, 3, 2, 3]
  assert all(i is False and b == "mosaic_gpu" and c.options == pp.MosaicOptions(**tb.CUTS)
             for i, b, c in seen)
  report = json.loads((tmp_path / "three_wgs_bits.json").read_text())
  assert report["ok"] and all("bitwise the same" in line for line in report["lines"])
  change.append(True)
  assert tb.main([]) == 1
  out = capsys.readouterr().out
  assert out.count("elements that differ [1, 0]") == 2 and "SOME DIFFER" in out
  tb.lower_all()
  assert capsys.readouterr().out.count(": lowered,") == 4
