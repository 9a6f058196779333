"""The native CPU decode attention (attention/cpu_decode.py): the values of a float64
softmax, only each sequence's own keys read, the torch backend's decode steps unchanged within
rounding, and every way it can be refused named."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.attention import cpu_decode, get_backend
from pdserve.attention.base import AttentionMetadata
from pdserve.attention.torch_backend import TorchBackend
from pdserve.engine.config import EngineArgs
from pdserve.engine.sampler import torch_argmax
from pdserve.sampling_params import SamplingParams
from services.prefill.config import PrefillConfig
from tests.engine.helpers import make_engine, random_prompts, run_all

runs_here = pytest.mark.skipif(
    bool(cpu_decode.missing_cpu_flags()),
    reason=f"the CPU lacks {cpu_decode.missing_cpu_flags()} (the kernel's instructions)")


ISA_FLAGS = {"avx2": set(cpu_decode.CPU_FLAGS),
             "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
             "avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}}


@pytest.fixture(params=list(ISA_FLAGS))
def isa(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Each instruction set the kernels are compiled for, where the CPU has it: AVX2 (two
    8-lane halves), AVX-512 (bfloat16 widened to float32 with FMA) and AVX-512-BF16
    (bfloat16 scores with vdpbf16ps)."""
    module = cpu_decode.module("on")
    lacks = sorted(ISA_FLAGS[request.param] - cpu_decode.cpu_flags())
    if lacks:
        pytest.skip(f"the CPU lacks {', '.join(lacks)} ({request.param})")
    before = module.isa()
    module.set_isa(request.param)
    yield request.param
    module.set_isa(before)


def reference(q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, scale: float
              ) -> torch.Tensor:
    """softmax(scale q k^T) v in float64, sequence by sequence, from ``kv``'s layout."""
    b, h, g, d = q.shape
    out = torch.empty(b, h, g, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        k = kv[0, i, :n].double().view(n, h, d).transpose(0, 1)  # [h, n, d]
        v = kv[1, i, :n].double().view(n, h, d).transpose(0, 1)
        out[i] = torch.softmax(q[i].double() @ k.transpose(1, 2) * scale, -1) @ v
    return out


def inputs(dtype: torch.dtype, b: int, h: int, g: int, d: int, lens: list[int], cap: int,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, g, d, generator=gen).to(dtype)
    kv = torch.randn(2, b, cap, h * d, generator=gen).to(dtype)
    return q, kv, torch.tensor(lens, dtype=torch.long)


@runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", cpu_decode.HEAD_DIMS)
def test_the_kernel_computes_attention(dtype: torch.dtype, d: int, isa: str) -> None:
    kernel = cpu_decode.load("on")
    assert kernel is not None
    for g in (1, 4, 8):
        # Lengths around the 4-key blocks and 16-lane softmax chunks; the view leaves unused
        # room after each sequence, as the decode mirror does.
        lens = [1, 2, 3, 4, 5, 15, 16, 17, 63, 130]
        q, kv, n = inputs(dtype, len(lens), 2, g, d, lens, cap=144, seed=g)
        view = kv[:, :, :130]
        got = kernel(q, view, n, d ** -0.5).double()
        expect = reference(q, view, n, d ** -0.5)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expect, atol=2e-6, rtol=2e-6)
        else:  # no worse than torch's SDPA on the same bfloat16 inputs
            k = view[0].view(len(lens), 130, 2, d).transpose(1, 2)
            v = view[1].view(len(lens), 130, 2, d).transpose(1, 2)
            mask = (torch.arange(130)[None, :] < n[:, None])[:, None, None, :]
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5)
            sdpa_err = (sdpa.double() - expect).abs().max().item()
            assert (got - expect).abs().max().item() <= max(sdpa_err, 1 / 128)


@runs_here
def test_the_kernels_run_the_widest_instruction_set_the_cpu_has() -> None:
    module = cpu_decode.module("on")
    widest = [name for name, flags in ISA_FLAGS.items() if flags <= cpu_decode.cpu_flags()][-1]
    assert module.isa() == widest
    assert cpu_decode.isa(module, torch.float32) == widest.replace("avx512bf16", "avx512")
    try:
        for name in ISA_FLAGS:
            if name == widest:
                break
            module.set_isa(name)  # a narrower one, as the tests run each
            assert module.isa() == name
        for name in list(ISA_FLAGS)[list(ISA_FLAGS).index(widest) + 1:]:
            with pytest.raises(RuntimeError) as err:
                module.set_isa(name)
            assert ("this CPU has no AVX-512-BF16 (vdpbf16ps)" if widest == "avx512" else
                    "this CPU has no AVX-512 (F, BW, VL and DQ)") in str(err.value)
        with pytest.raises(RuntimeError) as err:
            module.set_isa("sse2")
        assert "isa must be avx2, avx512 or avx512bf16, got sse2" in str(err.value)
    finally:
        module.set_isa(widest)


@runs_here
def test_no_key_past_a_sequences_length_is_read(isa: str) -> None:
    """NaN after each sequence's keys changes nothing, bit for bit."""
    kernel = cpu_decode.load("on")
    assert kernel is not None
    lens = [3, 7, 20]
    for dtype in (torch.float32, torch.bfloat16):
        q, kv, n = inputs(dtype, 3, 2, 4, 64, lens, cap=24)
        clean = kernel(q, kv, n, 0.125)
        for i, m in enumerate(lens):
            kv[:, i, m:] = float("nan")
        assert torch.equal(kernel(q, kv, n, 0.125), clean)


@runs_here
@pytest.mark.parametrize(("change", "message"), [
    (lambda q, kv, n: (q.transpose(2, 3), kv, n), "q must be a contiguous [B, H, G, D] tensor"),
    (lambda q, kv, n: (q.half(), kv.half(), n), "q must be float32 or bfloat16"),
    (lambda q, kv, n: (q, kv.bfloat16(), n), "kv must have q's dtype"),
    (lambda q, kv, n: (q, kv[:, :, :, :64], n),
     "kv must be [2, B, L, H * D] with contiguous rows"),
    (lambda q, kv, n: (q, kv, n.int()), "lens must be a contiguous int64 [B]"),
    (lambda q, kv, n: (q, kv, n + 100), "every length must be in [1, kv.size(2)]"),
    (lambda q, kv, n: (q, kv, n * 0), "every length must be in [1, kv.size(2)]"),
])
def test_bad_inputs_are_refused_by_name(change, message) -> None:  # type: ignore[no-untyped-def]
    kernel = cpu_decode.load("on")
    assert kernel is not None
    q, kv, n = change(*inputs(torch.float32, 2, 2, 4, 64, [3, 5], cap=8))
    with pytest.raises(RuntimeError) as err:
        kernel(q, kv, n, 0.125)
    assert message in str(err.value)


def test_a_head_dim_it_was_not_built_for_is_named() -> None:
    q, kv, n = inputs(torch.float32, 1, 1, 1, 48, [2], cap=2)
    assert cpu_decode.serves(48, 4, 1, torch.float32) == \
        "head_dim 48 (one of (32, 64, 96, 128, 256))"
    assert cpu_decode.serves(64, 32, 2, torch.float32) == \
        "32 query heads over 2 KV heads (at most 8 per KV head)"
    assert cpu_decode.serves(64, 8, 2, torch.float16) == \
        "dtype torch.float16 (float32 or bfloat16 only)"
    assert cpu_decode.serves(64, 8, 2, torch.bfloat16) is None
    with pytest.raises(ValueError) as err:
        get_backend("torch", [torch.zeros(4, 2, 4, 1, 48)], num_qo_heads=4, native="on")
    assert str(err.value) == ("native_kernels 'on' cannot serve this model: head_dim 48 "
                              "(one of (32, 64, 96, 128, 256))")
    assert get_backend("torch", [torch.zeros(4, 2, 4, 1, 48)], num_qo_heads=4,
                       native="auto").native is None  # type: ignore[attr-defined]
    del q, kv, n


def test_a_cpu_without_the_instructions_falls_back_or_fails_by_name(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_decode, "_built", None)
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: {"sse4_2", "avx"})
    caplog.set_level(logging.INFO, logger=cpu_decode.__name__)
    assert cpu_decode.load("auto") is None
    assert [r.fields for r in caplog.records if hasattr(r, "fields")] == [  # type: ignore[attr-defined]
        {"reason": "the CPU lacks avx2, fma"}]
    with pytest.raises(ValueError) as err:
        cpu_decode.load("on")
    assert str(err.value) == ("native_kernels 'on': the native CPU kernels cannot run here: "
                              "the CPU lacks avx2, fma")
    with pytest.raises(ValueError) as err:
        make_engine(num_blocks=16, native_kernels="on")
    assert "the CPU lacks avx2, fma" in str(err.value)
    engine = make_engine(num_blocks=16)  # auto: SDPA, and it serves
    assert engine.runner.backend.native is None  # type: ignore[attr-defined]
    tokens, _, _ = run_all(engine, [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(tokens[0]) == 3


def test_a_failed_build_falls_back_and_names_the_error(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path) -> None:  # type: ignore[no-untyped-def]
    from torch.utils import cpp_extension

    def no_compiler(**kwargs: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(cpu_decode, "_built", None)
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: set(cpu_decode.CPU_FLAGS))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    assert cpu_decode.load("auto") is None
    with pytest.raises(ValueError) as err:
        cpu_decode.load("on")
    assert str(err.value) == ("native_kernels 'on': the native CPU kernels cannot run here: "
                              "the build failed: Ninja is required to load C++ extensions")


def test_a_bad_mode_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError) as err:
        EngineArgs(native_kernels="fast")
    assert str(err.value) == ("native_kernels must be one of ('auto', 'on', 'off'), "
                              "got 'fast'")
    assert PrefillConfig.from_argv([], environ={}).engine_args().native_kernels == "auto"
    assert PrefillConfig.from_argv(["--native-kernels", "off"], environ={}
                                   ).engine_args().native_kernels == "off"
    with pytest.raises(SystemExit) as exit_:
        PrefillConfig.from_argv(["--native-kernels", "fast"], environ={})
    assert exit_.value.code == 2
    assert "--native-kernels" in capsys.readouterr().err


@runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_decode_steps_match_sdpa(dtype: torch.dtype) -> None:
    """The same paged decode steps (ragged lengths, mirror on) through the kernel and SDPA."""
    page, kvh, heads, hd = 4, 2, 8, 32
    caches = [torch.randn(32, 2, page, kvh, hd).to(dtype) for _ in range(2)]
    native = TorchBackend(caches, native=cpu_decode.load("on"))
    plain = TorchBackend([c.clone() for c in caches])
    lens, tables = [5, 9, 13], [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        slots = [t[n // page] * page + n % page for t, n in zip(tables, lens, strict=True)]
        lens = [n + 1 for n in lens]
        q = torch.randn(3, heads, hd, generator=g).to(dtype)
        k, v = (torch.randn(3, kvh, hd, generator=g).to(dtype) for _ in range(2))
        outs = []
        for backend in (native, plain):
            backend.prepare(AttentionMetadata(
                qo_indptr=torch.arange(4, dtype=torch.int32), page_table=tables,
                kv_lens=torch.tensor(lens, dtype=torch.int32),
                slot_mapping=torch.tensor(slots), is_decode_only=True, seq_ids=["a", "b", "c"]))
            outs.append(torch.stack([backend.forward(i, q, k, v) for i in range(2)]))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


@runs_here
def test_greedy_tokens_equal_with_and_without_the_kernel() -> None:
    prompts = random_prompts([7, 19, 33, 50], seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    on = make_engine(num_blocks=64, native_kernels="on")
    off = make_engine(num_blocks=64, native_kernels="off")
    assert on.runner.backend.native is not None  # type: ignore[attr-defined]
    assert off.runner.backend.native is None  # type: ignore[attr-defined]
    assert on.runner.sampler.argmax is not torch_argmax  # the native one picks the tokens
    assert off.runner.sampler.argmax is torch_argmax
    assert run_all(on, prompts, params)[0] == run_all(off, prompts, params)[0]


@runs_here
def test_the_argmax_is_torchs(isa: str) -> None:
    """The sampler's native argmax gives torch.argmax's index on every row: the first of
    tied maxima, the first NaN where a row has one, at widths that end in the 16-lane body or
    in the tail."""
    argmax = cpu_decode.argmax("on")
    assert argmax is not None
    g = torch.Generator().manual_seed(11)
    for width in (1, 2, 15, 16, 17, 40, 49152):
        x = torch.randn(10, width, generator=g)
        x[1] = 0.0  # all tied
        x[2] = -float("inf")
        x[3, -1] = 100.0  # the last lane, or the tail
        x[4, width // 3] = x[4, width - 1] = 50.0  # tied maxima
        x[5, width // 2], x[5, 0] = float("nan"), float("inf")  # NaN beats inf
        x[6, -1] = float("nan")
        x[7] = -1.0
        x[7, width // 2], x[7, -1] = -0.0, 0.0  # signed zeros are equal
        x[8] = torch.randint(0, 3, (width,), generator=g).float()
        x[9, width // 4] = float("inf")
        got = argmax(x)
        assert got.dtype == torch.long
        assert torch.equal(got, x.argmax(-1)), width
    other = torch.randn(3, 40, generator=g)
    for rows in (other.bfloat16(), other.t(), other[:0]):  # torch's, or made contiguous
        assert torch.equal(argmax(rows), rows.argmax(-1))


@runs_here
def test_the_argmax_kernel_refuses_other_rows_by_name() -> None:
    module = cpu_decode.module("on")
    for rows in (torch.randn(2, 4).double(), torch.randn(4, 2).t(), torch.randn(2, 0),
                 torch.randn(8)):
        with pytest.raises(RuntimeError) as err:
            module.argmax_f32(rows)
        assert "x must be a contiguous float32 CPU [T, N] tensor, N >= 1" in str(err.value)


@runs_here
def test_a_built_module_loads_without_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """An image removes the compiler after building: loading needs neither it nor ninja."""
    from torch.utils import cpp_extension

    assert cpu_decode.load("on") is not None  # built (make setup builds it ahead)
    assert (cpu_decode.build_dir() / f"{cpu_decode.NAME}.so").is_file()

    def no_compiler(**kwargs: object) -> None:
        raise AssertionError("the built module is loaded, never rebuilt")

    monkeypatch.setattr(cpu_decode, "_built", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    kernel = cpu_decode.load("on")
    assert kernel is not None
    q, kv, n = inputs(torch.float32, 1, 2, 4, 64, [5], cap=5)
    torch.testing.assert_close(kernel(q, kv, n, 0.125).double(), reference(q, kv, n, 0.125),
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(("says", "flags"), [
    ("g++ (Debian 12.2.0-14+deb12u1) 12.2.0", cpu_decode.CFLAGS),
    ("Debian clang version 14.0.6", cpu_decode.CLANG_CFLAGS),
    (None, cpu_decode.CFLAGS)], ids=["gcc", "clang", "not-there"])
def test_the_flags_follow_the_compiler_cpp_extension_runs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, says: str | None,
        flags: list[str]) -> None:
    """$CXX picks the compiler (as cpp_extension does): clang gets no -fopenmp (torch's
    OpenMP runtime is GCC's), GCC and a compiler that cannot be asked get every flag, and each
    set of flags builds into a directory of its own."""
    cxx = tmp_path / "cxx"
    if says is not None:
        cxx.write_text(f"#!/bin/sh\necho '{says}'\n")
        cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    assert cpu_decode.compiler() == str(cxx)
    assert cpu_decode.cflags() == flags
    assert ("-fopenmp" in flags) is (says is None or "clang" not in says)
    assert cpu_decode.build_dir() == cpu_decode.build_dir(flags)
    assert cpu_decode.build_dir(cpu_decode.CFLAGS) != cpu_decode.build_dir(
        cpu_decode.CLANG_CFLAGS)


def _cut_short() -> bytes:
    """The first 16 KiB of the module this machine built: dlopen accepts its headers, and
    loading it would then die of SIGBUS."""
    if cpu_decode.load("auto") is None:
        pytest.skip("no built module here to cut short (the CPU lacks the instructions)")
    return (cpu_decode.build_dir() / f"{cpu_decode.NAME}.so").read_bytes()[:16384]


@pytest.mark.parametrize("content", [lambda: b"not a shared object", _cut_short],
                         ids=["not-elf", "cut-short"])
def test_a_module_that_does_not_load_is_built_again(
        monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
        content) -> None:
    """A cached module cut short (a build killed while linking) or not a module at all is
    removed and built again, with a warning naming it, instead of leaving every later engine
    on SDPA, or crashing the engine that loads it."""
    from torch.utils import cpp_extension

    data = content()
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    built = cpu_decode.build_dir() / f"{cpu_decode.NAME}.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(data)
    assert not cpu_decode.whole_elf(built)
    builds: list[object] = []

    def rebuild(**kwargs: object) -> str:
        assert not built.exists(), "the broken module is removed before the build"
        builds.append(kwargs["build_directory"])
        (Path(str(kwargs["build_directory"])) / f"{cpu_decode.NAME}.so").write_bytes(b"new")
        return "rebuilt"

    monkeypatch.setattr(cpp_extension, "load", rebuild)
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert cpu_decode.build() == ("rebuilt", "")
    assert builds == [f"{built.parent}.build-{os.getpid()}"]
    assert built.read_bytes() == b"new"  # the new build moved into place
    assert [r.getMessage() for r in caplog.records] == [
        "native CPU kernels: the built module does not load; building it again"]
    assert caplog.records[0].fields["path"] == str(built)  # type: ignore[attr-defined]


def test_a_build_is_moved_into_place_only_whole(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A build runs in a directory of its own: one that fails (or is killed, leaving an
    object file cut short for ninja to link from) leaves nothing where engines look, and the
    directory of a killed build is removed by the next one."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    path = cpu_decode.build_dir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid nothing runs under now
    killed = path.with_name(f"{path.name}.build-{dead.pid}")
    killed.mkdir()
    (killed / "cpu_decode_attention.o").write_bytes(b"half")
    stages: list[Path] = []

    def half_built(**kwargs: object) -> None:
        stage = Path(str(kwargs["build_directory"]))
        stages.append(stage)
        (stage / "cpu_elementwise.o").write_bytes(b"half")
        raise RuntimeError("Error building extension 'pdserve_cpu_decode_attention'\nmore")

    monkeypatch.setattr(cpp_extension, "load", half_built)
    assert cpu_decode.build() == (None, "the build failed: Error building extension "
                                        "'pdserve_cpu_decode_attention'")
    assert not killed.exists()
    assert stages == [path.with_name(f"{path.name}.build-{os.getpid()}")]
    assert not stages[0].exists() and not path.exists()

    theirs = b"theirs"

    def other_engine_first(**kwargs: object) -> str:
        path.mkdir()  # another engine's whole build lands while this one compiles
        (path / f"{cpu_decode.NAME}.so").write_bytes(theirs)
        (Path(str(kwargs["build_directory"])) / f"{cpu_decode.NAME}.so").write_bytes(b"mine")
        return "mine"

    monkeypatch.setattr(cpp_extension, "load", other_engine_first)
    monkeypatch.setattr(cpu_decode, "whole_elf", lambda p: p.exists())
    assert cpu_decode.build() == ("mine", "")
    assert (path / f"{cpu_decode.NAME}.so").read_bytes() == theirs
    # ...and its lock, left in place (removing it could let two builds each hold one)
    assert sorted(path.parent.iterdir()) == [path, path.with_name(f"{path.name}.lock")]


def test_engines_building_at_once_build_once(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    """Engines started side by side on a machine without the module: one builds it, the
    others wait for that build and load its module instead of compiling it again each."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    builds: list[str] = []
    building = threading.Event()

    def slow_build(**kwargs: object) -> str:
        builds.append(str(kwargs["build_directory"]))
        building.set()
        time.sleep(0.3)  # the others arrive while this one compiles
        (Path(str(kwargs["build_directory"])) / f"{cpu_decode.NAME}.so").write_bytes(b"so")
        return "built"

    monkeypatch.setattr(cpp_extension, "load", slow_build)
    monkeypatch.setattr(cpu_decode, "whole_elf", lambda p: p.exists())
    monkeypatch.setattr(cpu_decode, "_load_built", lambda p: "loaded" if p.exists() else None)
    results: list[tuple[object, str]] = []
    first = threading.Thread(target=lambda: results.append(cpu_decode.build()))
    first.start()
    assert building.wait(10)
    others = [threading.Thread(target=lambda: results.append(cpu_decode.build()))
              for _ in range(2)]
    for t in others:
        t.start()
    for t in (first, *others):
        t.join(30)
    assert len(builds) == 1
    assert sorted(results, key=str) == [("built", ""), ("loaded", ""), ("loaded", "")]


def test_a_kernel_cache_that_cannot_be_a_directory_is_named(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """$PDSERVE_KERNEL_CACHE naming a file (an operator's typo): SDPA serves under "auto";
    "on" fails naming the path."""
    taken = tmp_path / "not-a-directory"
    taken.write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(taken))
    monkeypatch.setattr(cpu_decode, "_built", None)
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: set(cpu_decode.CPU_FLAGS))
    assert cpu_decode.load("auto") is None
    with pytest.raises(ValueError) as err:
        cpu_decode.load("on")
    assert str(err.value) == (
        "native_kernels 'on': the native CPU kernels cannot run here: the build failed: "
        f"the kernel cache {taken} is not a directory (PDSERVE_KERNEL_CACHE, default "
        "~/.cache/pdserve/kernels)")


def test_the_image_build_names_a_failure(monkeypatch: pytest.MonkeyPatch, tmp_path,  # type: ignore[no-untyped-def]
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from torch.utils import cpp_extension

    def broken(**kwargs: object) -> None:
        raise RuntimeError("Error building extension 'pdserve_cpu_decode_attention'")

    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken)
    assert cpu_decode.main(["--any-cpu"]) == 1
    assert capsys.readouterr().out == ("native decode attention: the build failed: Error "
                                       "building extension 'pdserve_cpu_decode_attention'\n")


@runs_here
def test_the_bf16_elementwise_kernels_round_like_the_torch_ones(isa: str) -> None:
    """RMSNorm with the residual add and SiLU-and-mul: each element within one bfloat16 step
    of the torch versions (which round like Hugging Face's), nearly all bit for bit; the
    residual sum exactly."""
    from pdserve.models.kernels import TORCH_KERNELS, CpuKernels

    native = CpuKernels(cpu_decode.module("on"))
    g = torch.Generator().manual_seed(5)
    for rows, width in ((1, 64), (7, 512), (32, 576)):
        x = (torch.randn(rows, width, generator=g) * 3).bfloat16()
        r = torch.randn(rows, width, generator=g).bfloat16()
        w = (torch.rand(width, generator=g) + 0.5).bfloat16()
        (got, total), (expect, expect_total) = (native.add_rms_norm(x, r, w, 1e-5),
                                                TORCH_KERNELS.add_rms_norm(x, r, w, 1e-5))
        assert torch.equal(total, expect_total)
        pairs = [(got, expect), (native.rms_norm(x, w, 1e-6), TORCH_KERNELS.rms_norm(x, w, 1e-6)),
                 (native.silu_and_mul(torch.cat([x * 2, r], 1)),
                  TORCH_KERNELS.silu_and_mul(torch.cat([x * 2, r], 1)))]
        for a, b in pairs:
            assert a.dtype == torch.bfloat16 and a.shape == b.shape
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)
            assert (a == b).float().mean().item() >= 0.99
    # A NaN stays a NaN where torch's does (its bits may differ: 0x7fc0, torch's scalar
    # rounding, against 0xffff from its vectorised one).
    x[0, 3], x[1, 5] = float("nan"), -float("nan")
    gate_up = torch.cat([x, r], 1)
    for a, b in ((native.rms_norm(x, w, 1e-6), TORCH_KERNELS.rms_norm(x, w, 1e-6)),
                 (native.silu_and_mul(gate_up), TORCH_KERNELS.silu_and_mul(gate_up))):
        assert torch.isnan(a).any()
        assert torch.equal(torch.isnan(a), torch.isnan(b))


@runs_here
def test_the_bf16_rope_equals_the_torch_one(isa: str) -> None:
    """q and k rotated from the fused projection's output (a view: the token stride spans
    v too), bit for bit as torch's bfloat16 ops give them, k contiguous; NaN where torch's."""
    from pdserve.models.kernels import TORCH_KERNELS, CpuKernels
    from pdserve.models.rope import RopeConfig, Rotary

    native = CpuKernels(cpu_decode.module("on"))
    g = torch.Generator().manual_seed(9)
    for tokens, head_dim, hq, hk in ((32, 64, 9, 3), (5, 32, 4, 4), (40, 128, 8, 1),
                                     (1, 256, 2, 2)):
        qkv = (torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g) * 4).bfloat16()
        qk = qkv[:, :(hq + hk) * head_dim].view(tokens, hq + hk, head_dim)
        positions = torch.randint(0, 32768, (tokens,), generator=g)
        inputs = TORCH_KERNELS.rope_inputs(Rotary(RopeConfig(), head_dim), positions,
                                           torch.bfloat16)
        (q, k), (eq, ek) = native.rope_qk(qk, hq, inputs), TORCH_KERNELS.rope_qk(qk, hq, inputs)
        assert torch.equal(q, eq) and torch.equal(k, ek), (tokens, head_dim)
        assert k.is_contiguous() and q.shape == eq.shape and k.shape == ek.shape
    qkv[0, 3], qkv[0, head_dim + 1] = float("nan"), float("inf")
    (q, k), (eq, ek) = native.rope_qk(qk, hq, inputs), TORCH_KERNELS.rope_qk(qk, hq, inputs)
    assert torch.equal(torch.isnan(q), torch.isnan(eq)) and torch.isnan(q).any()
    assert torch.equal(q.nan_to_num(0.0), eq.nan_to_num(0.0))


@runs_here
@pytest.mark.parametrize(("change", "message"), [
    (lambda qk, c, s: (qk.float(), c, s), "qk must be a bfloat16 CPU [T, H, D] tensor"),
    (lambda qk, c, s: (qk.transpose(0, 1), c, s), "qk must be a bfloat16 CPU [T, H, D] tensor"),
    (lambda qk, c, s: (qk[:, :, :48], c[:, :24], s[:, :24]),
     "qk must be a bfloat16 CPU [T, H, D] tensor"),
    (lambda qk, c, s: (qk, c[:, :16], s), "cos and sin must be contiguous bfloat16 [T, D / 2]"),
    (lambda qk, c, s: (qk, c, s.t().contiguous().t()),
     "cos and sin must be contiguous bfloat16 [T, D / 2]"),
])
def test_the_rope_kernel_refuses_other_shapes_by_name(change, message) -> None:  # type: ignore[no-untyped-def]
    module = cpu_decode.module("on")
    qk = torch.randn(4, 6, 64).bfloat16()
    cos, sin = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16()
    with pytest.raises(RuntimeError) as err:
        module.rope_qk_bf16(*change(qk, cos, sin), 4)
    assert message in str(err.value)
    with pytest.raises(RuntimeError) as err:
        module.rope_qk_bf16(qk, cos, sin, 7)
    assert "num_q_heads must be in [0, H]" in str(err.value)


@runs_here
def test_float32_and_other_shapes_keep_the_torch_kernels() -> None:
    from pdserve.models.kernels import TORCH_KERNELS, CpuKernels

    native = CpuKernels(cpu_decode.module("on"))
    x = torch.randn(3, 4, 32)  # per-head norms (q/k norm) are 3-D; float32 stays torch
    w = torch.rand(32)
    assert torch.equal(native.rms_norm(x, w, 1e-6), TORCH_KERNELS.rms_norm(x, w, 1e-6))
    xb = torch.randn(3, 40).bfloat16()  # a width the kernel does not take
    assert torch.equal(native.rms_norm(xb, torch.ones(40).bfloat16(), 1e-6),
                       TORCH_KERNELS.rms_norm(xb, torch.ones(40).bfloat16(), 1e-6))
    # RoPE: float32, and a head_dim whose half is no multiple of 16, stay torch's
    from pdserve.models.rope import RopeConfig, Rotary

    for dtype, head_dim in ((torch.float32, 64), (torch.bfloat16, 48)):
        qk = torch.randn(3, 4, head_dim).to(dtype)
        inputs = TORCH_KERNELS.rope_inputs(Rotary(RopeConfig(), head_dim), torch.arange(3),
                                           dtype)
        for a, b in zip(native.rope_qk(qk, 2, inputs), TORCH_KERNELS.rope_qk(qk, 2, inputs),
                        strict=True):
            assert torch.equal(a, b)


def test_kernels_follow_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.models import kernels
    from pdserve.models.rope import RopeConfig, Rotary

    rotary, cpu = Rotary(RopeConfig(), 64), torch.device("cpu")
    assert kernels.kernels_for(rotary, 64, cpu, torch.bfloat16, "off") is kernels.TORCH_KERNELS
    assert kernels.kernels_for(rotary, 64, cpu, torch.float32, "on") is kernels.TORCH_KERNELS
    if not cpu_decode.missing_cpu_flags():
        assert kernels.kernels_for(rotary, 64, cpu, torch.bfloat16, "auto").name == "cpu-native"
    monkeypatch.setattr(cpu_decode, "_built", None)
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: set())
    assert kernels.kernels_for(rotary, 64, cpu, torch.bfloat16, "auto") is kernels.TORCH_KERNELS
    with pytest.raises(ValueError) as err:
        kernels.kernels_for(rotary, 64, cpu, torch.bfloat16, "on")
    assert str(err.value).startswith("native_kernels 'on': the native CPU kernels cannot run "
                                     "here: the CPU lacks avx2, fma")


@pytest.mark.parametrize(("flags", "warned"), [
    ({"avx2", "avx512f"}, True),  # bfloat16 emulated: 3.4x slower than float32 (Xeon)
    ({"avx2", "fma"}, True),  # 5.1-7.6x (EPYC, AVX2 only)
    ({"avx512f", "avx512_bf16"}, False),
    ({"avx512f", "amx_bf16"}, False),
    (set(), False),  # flags unknown (not x86 Linux): nothing said
])
def test_bfloat16_on_a_cpu_that_emulates_it_is_warned(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, flags: set[str],
        warned: bool) -> None:
    from pdserve.models import kernels
    from pdserve.models.rope import RopeConfig, Rotary

    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: flags)
    rotary, cpu = Rotary(RopeConfig(), 64), torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        for dtype in (torch.float32, torch.bfloat16):
            kernels.kernels_for(rotary, 64, cpu, dtype, "off")
    assert [r.getMessage() for r in caplog.records] == (
        ["bfloat16 on a CPU without AVX-512-BF16 or AMX: its matrix products run 3-8x slower "
         "than float32's here; --dtype float32 serves faster"] if warned else [])
